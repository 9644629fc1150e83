//! One module per subcommand.
pub mod bench;
pub mod embed;
pub mod generate;
pub mod load;
pub mod ls;
pub mod pull;
pub mod serve;
pub mod tools;
