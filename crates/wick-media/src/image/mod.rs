//! Images: decoding ([`decode`]), Pillow-exact resampling ([`resample`]) and the towers'
//! processors ([`processor`]).
pub mod decode;
pub mod processor;
pub mod resample;
