//! Decoding an encoded image into RGB pixels, safely: size limits checked before anything
//! is allocated, the format sniffed from the bytes, EXIF orientation applied, transparency
//! dropped as transformers' `load_image` does.
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};

use crate::error::MediaError;

/// The image formats read, as named in errors.
pub const IMAGE_FORMATS: &str = "PNG, JPEG, WebP, GIF, BMP, TIFF";

/// What an image may cost before it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Largest encoded size in bytes.
    pub max_bytes: usize,
    /// Largest width or height in pixels.
    pub max_side: u32,
    /// Most pixels (width × height).
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// 20 MB encoded, 8192 px per side, 40 megapixels.
    fn default() -> Self {
        ImageLimits {
            max_bytes: 20 * 1024 * 1024,
            max_side: 8192,
            max_pixels: 40_000_000,
        }
    }
}

/// An 8-bit RGB image, rows top to bottom, pixels interleaved `r g b`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `height × width × 3` bytes.
    pub data: Vec<u8>,
}

/// Decodes `bytes` (any of [`IMAGE_FORMATS`]; the format is sniffed from the bytes, a GIF
/// gives its first frame) into upright RGB within `limits`.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    const KIND: &str = "image";
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
    let format = sniff_image(bytes)?;
    let failed = |reason: String| MediaError::Decode {
        kind: KIND,
        format: format_name(format).to_string(),
        reason,
    };
    // Decoders are third-party code fed hostile bytes: a panic inside is a bad image.
    let decoded = catch_unwind(AssertUnwindSafe(|| -> Result<DynamicImage, MediaError> {
        let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
        let mut decoder_limits = Limits::default();
        decoder_limits.max_image_width = Some(limits.max_side);
        decoder_limits.max_image_height = Some(limits.max_side);
        // RGBA with 16 bits per channel is the most a decoder holds per pixel, plus slack
        // for its own buffers.
        decoder_limits.max_alloc =
            Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
        reader.limits(decoder_limits);
        let mut decoder = reader
            .into_decoder()
            .map_err(|e| over_limit_or(e, limits, &failed))?;
        let (width, height) = decoder.dimensions();
        check_size(width, height, limits)?;
        let orientation = decoder.orientation().map_err(|e| failed(e.to_string()))?;
        let mut image = if format == ImageFormat::Jpeg {
            drop(decoder);
            decode_jpeg(bytes).map_err(failed)?
        } else {
            DynamicImage::from_decoder(decoder).map_err(|e| failed(e.to_string()))?
        };
        image.apply_orientation(orientation);
        Ok(image)
    }))
    .map_err(|_| failed("the decoder failed on malformed data".into()))??;
    Ok(to_rgb(decoded))
}

/// JPEG pixels as libjpeg-turbo (Pillow's decoder) makes them: accurate integer IDCT,
/// smooth chroma upsampling, converted to RGB by the library.
fn decode_jpeg(bytes: &[u8]) -> Result<DynamicImage, String> {
    // libjpeg fills a truncated scan with gray and only warns; Pillow refuses such a file.
    // Inside entropy-coded data 0xFF is always stuffed, so an end-of-image marker after the
    // last start-of-scan means the data is complete.
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
    let end = bytes.windows(2).rposition(|w| w == [0xFF, 0xD9]);
    match (last_scan, end) {
        (Some(scan), Some(end)) if end > scan => {}
        _ => {
            return Err(
                "the JPEG data is truncated (no end-of-image marker after the last scan)".into(),
            )
        }
    }
    let decompress = mozjpeg::Decompress::new_mem(bytes).map_err(|e| e.to_string())?;
    let mut started = decompress.rgb().map_err(|e| e.to_string())?;
    let (width, height) = (started.width(), started.height());
    let pixels: Vec<[u8; 3]> = started.read_scanlines().map_err(|e| e.to_string())?;
    started.finish().map_err(|e| e.to_string())?;
    if pixels.len() != width * height {
        return Err(format!(
            "the JPEG data ends after {} of {height} rows",
            pixels.len() / width.max(1)
        ));
    }
    let data: Vec<u8> = pixels.into_iter().flatten().collect();
    image::RgbImage::from_raw(width as u32, height as u32, data)
        .map(DynamicImage::ImageRgb8)
        .ok_or_else(|| "the JPEG's pixel buffer does not match its size".to_string())
}

/// The format the bytes are in, from their signature.
pub fn sniff_image(bytes: &[u8]) -> Result<ImageFormat, MediaError> {
    match image::guess_format(bytes) {
        Ok(
            f @ (ImageFormat::Png
            | ImageFormat::Jpeg
            | ImageFormat::WebP
            | ImageFormat::Gif
            | ImageFormat::Bmp
            | ImageFormat::Tiff),
        ) => Ok(f),
        _ => Err(MediaError::UnknownFormat {
            kind: "image",
            head: hex_head(bytes),
            supported: IMAGE_FORMATS,
        }),
    }
}

/// The first bytes of an input, in hex, for error messages.
pub(crate) fn hex_head(bytes: &[u8]) -> String {
    let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    if head.is_empty() {
        "nothing".into()
    } else {
        head.join(" ")
    }
}

fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        ImageFormat::Gif => "GIF",
        ImageFormat::Bmp => "BMP",
        ImageFormat::Tiff => "TIFF",
        _ => "image",
    }
}

fn check_size(width: u32, height: u32, limits: &ImageLimits) -> Result<(), MediaError> {
    if width > limits.max_side
        || height > limits.max_side
        || u64::from(width) * u64::from(height) > limits.max_pixels
    {
        return Err(MediaError::TooManyPixels {
            width,
            height,
            max_side: limits.max_side,
            max_pixels: limits.max_pixels,
        });
    }
    Ok(())
}

/// A decoder's limit error becomes [`MediaError::TooManyPixels`] when the header says so.
fn over_limit_or(
    e: image::ImageError,
    limits: &ImageLimits,
    failed: &dyn Fn(String) -> MediaError,
) -> MediaError {
    match e {
        image::ImageError::Limits(_) => MediaError::TooManyPixels {
            width: 0,
            height: 0,
            max_side: limits.max_side,
            max_pixels: limits.max_pixels,
        },
        other => failed(other.to_string()),
    }
}

/// RGB bytes; an alpha channel is dropped, as transformers' `load_image` does
/// (`Image.convert("RGB")`) before any processor sees the image.
fn to_rgb(image: DynamicImage) -> RgbImage {
    let (width, height) = (image.width() as usize, image.height() as usize);
    RgbImage {
        width,
        height,
        data: image.into_rgb8().into_raw(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_bytes_name_their_head() {
        let err = decode_image(b"GIF-not-really", &ImageLimits::default()).unwrap_err();
        assert!(err.to_string().contains("47 49 46"), "{err}");
    }
}
