//! Audio: decoding to mono ([`decode`]), resampling ([`resample`]) and the towers' log-mel
//! features ([`mel`]).
mod container;
pub mod decode;
pub mod mel;
pub mod resample;
