//! One module per subcommand.
pub mod bench;
pub mod generate;
pub mod ls;
pub mod pull;
pub mod serve;
pub mod tools;
