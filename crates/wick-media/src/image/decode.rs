//! Decoding an encoded image into RGB pixels, safely: size limits checked before anything
//! is allocated, the format sniffed from the bytes, EXIF orientation applied, transparency
//! dropped as transformers' `load_image` does.
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};

use image::codecs::png::PngDecoder;
use image::metadata::Orientation;
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

/// What an image's header says, read without decoding its pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// The format sniffed from the bytes.
    pub format: ImageFormat,
    /// Width in pixels, upright (after the EXIF orientation).
    pub width: u32,
    /// Height in pixels, upright.
    pub height: u32,
}

/// Reads `bytes`' header (any of [`IMAGE_FORMATS`]) within `limits` without decoding its
/// pixels: what the image will cost (its size, the soft tokens a processor gives it) is
/// known before anything large is allocated.
pub fn probe_image(bytes: &[u8], limits: &ImageLimits) -> Result<ImageHeader, MediaError> {
    let format = check_bytes(bytes, limits)?;
    let failed = decode_failure(format);
    guarded(&failed, || {
        let (mut decoder, width, height) = open(bytes, format, limits, &failed)?;
        let orientation = decoder.orientation().map_err(|e| failed(e.to_string()))?;
        let (width, height) = match orientation {
            Orientation::Rotate90
            | Orientation::Rotate270
            | Orientation::Rotate90FlipH
            | Orientation::Rotate270FlipH => (height, width),
            _ => (width, height),
        };
        Ok(ImageHeader {
            format,
            width,
            height,
        })
    })
}

/// Decodes `bytes` (any of [`IMAGE_FORMATS`]; the format is sniffed from the bytes, a GIF
/// gives its first frame) into upright RGB within `limits`.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    let format = check_bytes(bytes, limits)?;
    let failed = decode_failure(format);
    let decoded = guarded(&failed, || {
        let (mut decoder, width, height) = open(bytes, format, limits, &failed)?;
        let orientation = decoder.orientation().map_err(|e| failed(e.to_string()))?;
        let mut image = if format == ImageFormat::Jpeg {
            drop(decoder);
            decode_jpeg(bytes, (width, height)).map_err(&failed)?
        } else {
            DynamicImage::from_decoder(decoder).map_err(|e| failed(e.to_string()))?
        };
        image.apply_orientation(orientation);
        Ok(image)
    })?;
    Ok(to_rgb(decoded))
}

const KIND: &str = "image";

/// What the PNG decoder may allocate for itself, apart from the pixels.
const PNG_OWN_BYTES: u64 = 64 << 20;

/// The encoded size within the limit, and the format the bytes are in.
fn check_bytes(bytes: &[u8], limits: &ImageLimits) -> Result<ImageFormat, MediaError> {
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
    sniff_image(bytes)
}

fn decode_failure(format: ImageFormat) -> impl Fn(String) -> MediaError {
    move |reason| MediaError::Decode {
        kind: KIND,
        format: format_name(format).to_string(),
        reason,
    }
}

/// Runs `f` on third-party decoders fed hostile bytes: a panic inside is a bad image.
fn guarded<T>(
    failed: &dyn Fn(String) -> MediaError,
    f: impl FnOnce() -> Result<T, MediaError>,
) -> Result<T, MediaError> {
    catch_unwind(AssertUnwindSafe(f))
        .map_err(|_| failed("the decoder failed on malformed data".into()))?
}

/// The decoder of `bytes` after its header, and the header's dimensions, checked against
/// `limits` (the decoder's own allocations are capped too).
fn open<'a>(
    bytes: &'a [u8],
    format: ImageFormat,
    limits: &ImageLimits,
    failed: &dyn Fn(String) -> MediaError,
) -> Result<(Box<dyn ImageDecoder + 'a>, u32, u32), MediaError> {
    if let Some((width, height)) = png_size(bytes).filter(|_| format == ImageFormat::Png) {
        // The PNG decoder reads every chunk up to the pixel data before telling the size.
        check_size(width, height, limits, failed)?;
    }
    let mut decoder: Box<dyn ImageDecoder + 'a> = if format == ImageFormat::Png {
        // The PNG decoder's own allocations (the chunks it keeps, a decompressed ICC profile,
        // a row) get a budget of their own: under the pixels' one, an ICC profile that
        // inflates 1000-fold could take hundreds of MB while only the header was wanted.
        let mut own = Limits::no_limits();
        own.max_alloc = Some(PNG_OWN_BYTES);
        Box::new(
            PngDecoder::with_limits(Cursor::new(bytes), own).map_err(|e| failed(e.to_string()))?,
        )
    } else {
        Box::new(
            ImageReader::with_format(Cursor::new(bytes), format)
                .into_decoder()
                .map_err(|e| failed(e.to_string()))?,
        )
    };
    // No side limits: the dimensions are checked below, so that the error reports them.
    // RGBA with 16 bits per channel is the most a decoder holds per pixel, plus slack for
    // its own buffers.
    let mut decoder_limits = Limits::no_limits();
    decoder_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    decoder
        .set_limits(decoder_limits)
        .map_err(|e| failed(e.to_string()))?;
    let (width, height) = decoder.dimensions();
    check_size(width, height, limits, failed)?;
    Ok((decoder, width, height))
}

/// JPEG pixels as libjpeg-turbo (Pillow's decoder) makes them: accurate integer IDCT,
/// smooth chroma upsampling, converted to RGB by the library.
fn decode_jpeg(bytes: &[u8], header: (u32, u32)) -> Result<DynamicImage, String> {
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
    // libjpeg allocates for the size it reads (a progressive scan's coefficients for the
    // whole image): it must be the size that was checked.
    let (width, height) = decompress.size();
    if (width as u64, height as u64) != (u64::from(header.0), u64::from(header.1)) {
        return Err(format!(
            "the JPEG declares {}×{} pixels in one header and {width}×{height} in another",
            header.0, header.1
        ));
    }
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

/// A PNG's size from its `IHDR` chunk, which must come first.
fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    match bytes.get(12..24)? {
        [b'I', b'H', b'D', b'R', w0, w1, w2, w3, h0, h1, h2, h3] => Some((
            u32::from_be_bytes([*w0, *w1, *w2, *w3]),
            u32::from_be_bytes([*h0, *h1, *h2, *h3]),
        )),
        _ => None,
    }
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

fn check_size(
    width: u32,
    height: u32,
    limits: &ImageLimits,
    failed: &dyn Fn(String) -> MediaError,
) -> Result<(), MediaError> {
    if width == 0 || height == 0 {
        return Err(failed(format!(
            "the header declares a {width}×{height} image"
        )));
    }
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
