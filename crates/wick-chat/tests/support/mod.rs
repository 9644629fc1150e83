//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod check;
pub mod fuzz_input;
