//! One module per subcommand.
pub mod bench;
pub mod embed;
pub mod fit;
pub mod fuse;
pub mod gc;
pub mod generate;
pub mod get;
pub mod inspect_dataset;
pub mod load;
pub mod ls;
pub mod pull;
pub mod rm;
pub mod serve;
pub mod tools;
pub mod train;
