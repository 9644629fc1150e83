//! Fuzz target: any bytes as a reply in any format (first byte picks it) must parse without
//! panic or hang, satisfy the API invariants, and stream to the same outcome in any chunking.
//! The checks are shared with the plain-test harness `tests/tool_call_fuzz.rs`.
#![no_main]
#![allow(dead_code)]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/support/check.rs"]
mod check;
#[path = "../../tests/support/fuzz_input.rs"]
mod fuzz_input;

fuzz_target!(|data: &[u8]| fuzz_input::fuzz_one(data));
