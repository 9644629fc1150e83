//! The one error type of wick-media: what was wrong with an input, with the limit or the
//! format it broke.
use thiserror::Error;

/// Why an image or audio clip could not be used.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MediaError {
    /// The encoded input is larger than allowed.
    #[error("the {kind} is {bytes} bytes, more than the limit of {limit} bytes")]
    TooLarge {
        /// "image" or "audio clip".
        kind: &'static str,
        /// Its size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// The input is empty.
    #[error("the {kind} is empty")]
    Empty {
        /// "image" or "audio clip".
        kind: &'static str,
    },
    /// The bytes are not in any format this server reads.
    #[error("unrecognized {kind} format (the bytes start with {head}); supported: {supported}")]
    UnknownFormat {
        /// "image" or "audio clip".
        kind: &'static str,
        /// The first bytes, in hex.
        head: String,
        /// The formats that are read.
        supported: &'static str,
    },
    /// The image's declared size is over the limit (checked from its header, before
    /// decoding).
    #[error("the image is {width}×{height} pixels, more than the limit of {max_side} px per side and {max_pixels} pixels")]
    TooManyPixels {
        /// Declared width.
        width: u32,
        /// Declared height.
        height: u32,
        /// Largest side allowed.
        max_side: u32,
        /// Most pixels allowed.
        max_pixels: u64,
    },
    /// The image or clip could not be decoded (truncated, corrupt, unsupported variant).
    #[error("could not decode the {format} {kind}: {reason}")]
    Decode {
        /// "image" or "audio clip".
        kind: &'static str,
        /// The format sniffed from its bytes.
        format: String,
        /// What the decoder said.
        reason: String,
    },
    /// The image or clip cannot be prepared with the processor's settings (a 0×0 image, one
    /// too elongated to resize, a clip that cannot be resampled to the extractor's rate).
    #[error("{0}")]
    Processor(String),
    /// The processor's settings, from the model's config, are invalid (the server's fault,
    /// not the input's).
    #[error("invalid media processor setting in the model's config: {0}")]
    Config(String),
    /// The audio clip's sample rate is outside what is read.
    #[error("the audio clip's sample rate is {rate} Hz, outside the {min}..={max} Hz read")]
    SampleRate {
        /// The declared rate.
        rate: u32,
        /// Lowest rate read.
        min: u32,
        /// Highest rate read.
        max: u32,
    },
    /// The audio clip has no samples.
    #[error("the audio clip has no samples")]
    NoSamples,
}
