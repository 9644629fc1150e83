//! Decoding an audio clip (WAV, MP3, FLAC, Ogg Vorbis) into mono `f32` samples: the format
//! sniffed from the bytes, channels averaged, at most a given duration kept.
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};

use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

use super::container;
use crate::error::MediaError;
use crate::image::decode::hex_head;

/// The audio formats read, as named in errors.
pub const AUDIO_FORMATS: &str = "WAV, MP3, FLAC, Ogg Vorbis";

/// A container format, sniffed from the first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFormat {
    /// RIFF WAVE.
    Wav,
    /// MPEG layer III (with or without an ID3 tag).
    Mp3,
    /// Native FLAC.
    Flac,
    /// Ogg (Vorbis).
    Ogg,
}

impl AudioFormat {
    /// The format of `bytes`, from their signature.
    pub fn sniff(bytes: &[u8]) -> Result<AudioFormat, MediaError> {
        let format = match bytes {
            [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => AudioFormat::Wav,
            [b'f', b'L', b'a', b'C', ..] => AudioFormat::Flac,
            [b'O', b'g', b'g', b'S', ..] => AudioFormat::Ogg,
            [b'I', b'D', b'3', ..] => AudioFormat::Mp3,
            [0xFF, b, ..] if b & 0xE0 == 0xE0 => AudioFormat::Mp3,
            _ => {
                return Err(MediaError::UnknownFormat {
                    kind: "audio clip",
                    head: hex_head(bytes),
                    supported: AUDIO_FORMATS,
                })
            }
        };
        Ok(format)
    }

    /// The usual file extension.
    pub fn extension(self) -> &'static str {
        match self {
            AudioFormat::Wav => "wav",
            AudioFormat::Mp3 => "mp3",
            AudioFormat::Flac => "flac",
            AudioFormat::Ogg => "ogg",
        }
    }
}

/// What a clip may cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AudioLimits {
    /// Largest encoded size in bytes.
    pub max_bytes: usize,
    /// Longest duration kept, in seconds (the rest is dropped).
    pub max_seconds: f64,
    /// Lowest sample rate read, in Hz.
    pub min_rate: u32,
    /// Highest sample rate read, in Hz: the samples kept grow with it
    /// (`max_seconds × max_rate`), and so does the resampling filter's reach.
    pub max_rate: u32,
}

impl Default for AudioLimits {
    /// 20 MB encoded, 30 s kept (Gemma 4's audio window), 1–192 kHz.
    fn default() -> Self {
        AudioLimits {
            max_bytes: 20 * 1024 * 1024,
            max_seconds: 30.0,
            min_rate: 1_000,
            max_rate: 192_000,
        }
    }
}

/// A decoded clip, mixed down to one channel.
#[derive(Debug, Clone, PartialEq)]
pub struct MonoClip {
    /// Samples per second.
    pub rate: u32,
    /// The samples, in −1..1.
    pub samples: Vec<f32>,
    /// Whether samples past `max_seconds` were dropped.
    pub truncated: bool,
}

/// Decodes `bytes` into a mono clip within `limits`; channels are averaged.
pub fn decode_audio(bytes: &[u8], limits: &AudioLimits) -> Result<MonoClip, MediaError> {
    const KIND: &str = "audio clip";
    if bytes.is_empty() {
        return Err(MediaError::Empty { kind: KIND });
    }
    if bytes.len() > limits.max_bytes {
        return Err(MediaError::TooLarge {
            kind: KIND,
            bytes: bytes.len(),
            limit: limits.max_bytes,
        });
    }
    let format = AudioFormat::sniff(bytes)?;
    let failed = |reason: String| MediaError::Decode {
        kind: KIND,
        format: format.extension().to_uppercase(),
        reason,
    };
    let (bytes, format) = container::check(bytes, format).map_err(&failed)?;
    let owned = bytes.to_vec();
    catch_unwind(AssertUnwindSafe(|| {
        decode_inner(owned, format, limits, &failed)
    }))
    .map_err(|_| failed("the decoder failed on malformed data".into()))?
}

/// A file whose data stops before the frame count its header declares is cut short (a
/// partial upload or a broken file), and is refused rather than heard in part. Lossless
/// containers must deliver every declared frame; MP3 may fall short by less than one MPEG
/// frame (1152 samples) of rounding in estimated counts. An Ogg stream whose final page
/// cannot be found (no declared length) ended early.
fn check_complete(
    format: AudioFormat,
    declared: Option<u64>,
    decoded: usize,
) -> Result<(), String> {
    const MP3_FRAME: u64 = 1152;
    let decoded = decoded as u64;
    match (format, declared) {
        (AudioFormat::Ogg, None) => {
            Err("the Ogg stream has no final page (the file is truncated)".into())
        }
        (_, None) => Ok(()),
        (AudioFormat::Mp3, Some(n)) if decoded + MP3_FRAME > n => Ok(()),
        (_, Some(n)) if decoded >= n => Ok(()),
        (_, Some(n)) => Err(format!(
            "the audio data is truncated ({decoded} of the {n} frames its header declares)"
        )),
    }
}

fn decode_inner(
    bytes: Vec<u8>,
    format: AudioFormat,
    limits: &AudioLimits,
    failed: &dyn Fn(String) -> MediaError,
) -> Result<MonoClip, MediaError> {
    let stream = MediaSourceStream::new(Box::new(Cursor::new(bytes)), Default::default());
    let mut hint = Hint::new();
    hint.with_extension(format.extension());
    let probed = symphonia::default::get_probe()
        .format(
            &hint,
            stream,
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
        .map_err(|e| failed(e.to_string()))?;
    let mut reader = probed.format;
    let track = reader
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| failed("no audio track".into()))?;
    let track_id = track.id;
    let declared_frames = track.codec_params.n_frames;
    let rate = track
        .codec_params
        .sample_rate
        .filter(|&r| r > 0)
        .ok_or_else(|| failed("no sample rate".into()))?;
    // The rate sizes everything after it: the samples kept, the resampling filter.
    if !(limits.min_rate..=limits.max_rate).contains(&rate) {
        return Err(MediaError::SampleRate {
            rate,
            min: limits.min_rate,
            max: limits.max_rate,
        });
    }
    if track.codec_params.channels.is_some_and(|c| c.count() == 0) {
        return Err(failed("the stream declares no channels".into()));
    }
    let mut decoder = symphonia::default::get_codecs()
        .make(&track.codec_params, &DecoderOptions::default())
        .map_err(|e| failed(e.to_string()))?;
    let max_frames = (limits.max_seconds * f64::from(rate)).ceil() as usize;
    let mut samples = Vec::new();
    let mut truncated = false;
    let mut buffer: Option<SampleBuffer<f32>> = None;
    loop {
        let packet = match reader.next_packet() {
            Ok(p) => p,
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break
            }
            Err(SymphoniaError::ResetRequired) => break,
            Err(e) => return Err(failed(e.to_string())),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = decoder.decode(&packet).map_err(|e| failed(e.to_string()))?;
        let spec = *decoded.spec();
        let channels = spec.channels.count().max(1);
        let buf = match &mut buffer {
            Some(b) if b.capacity() >= decoded.capacity() * channels => b,
            _ => buffer.insert(SampleBuffer::new(decoded.capacity() as u64, spec)),
        };
        buf.copy_interleaved_ref(decoded);
        for frame in buf.samples().chunks_exact(channels) {
            if samples.len() == max_frames {
                truncated = true;
                break;
            }
            let sum: f32 = frame.iter().sum();
            samples.push(sum / channels as f32);
        }
        if truncated {
            break;
        }
    }
    if samples.is_empty() {
        return Err(MediaError::NoSamples);
    }
    if !truncated {
        check_complete(format, declared_frames, samples.len()).map_err(failed)?;
    }
    Ok(MonoClip {
        rate,
        samples,
        truncated,
    })
}
