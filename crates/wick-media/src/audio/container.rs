//! The containers' own size fields, checked before symphonia reads them. Symphonia allocates
//! what some fields declare before it reads the bytes they describe: a WAV `LIST` entry, a
//! FLAC or Ogg comment or picture, an ID3v2 frame, a Vorbis codebook's lookup table (entries
//! × dimensions). A few bytes could ask for gigabytes, or terabytes, and a failed allocation
//! aborts the process. Here every such size must fit in the bytes that are there (and a
//! codebook within what real encoders write); ID3v2 tags, which carry no audio, are skipped.

use std::collections::HashMap;

use super::decode::AudioFormat;

/// Most entries of a Vorbis codebook (libvorbis writes at most a few thousand).
const MAX_CODEBOOK_ENTRIES: u64 = 1 << 20;
/// Most values of a Vorbis codebook's lookup table (entries × dimensions, 16 MB as `f32`).
const MAX_CODEBOOK_VALUES: u64 = 1 << 22;
/// Most logical streams of an Ogg file (a clip has one; chained files a few).
const MAX_OGG_STREAMS: usize = 64;

/// The bytes to decode, past any leading ID3v2 tags, and their format; an error names the
/// size that does not fit.
pub(crate) fn check(bytes: &[u8], format: AudioFormat) -> Result<(&[u8], AudioFormat), String> {
    let (bytes, format) = if format == AudioFormat::Mp3 {
        skip_id3v2(bytes)?
    } else {
        (bytes, format)
    };
    match format {
        AudioFormat::Wav => check_wav(bytes)?,
        AudioFormat::Flac => check_flac(bytes)?,
        AudioFormat::Ogg => check_ogg(bytes)?,
        AudioFormat::Mp3 => {}
    }
    Ok((bytes, format))
}

/// Skips leading ID3v2 tags (their frames declare sizes symphonia allocates first); what
/// follows is sniffed again (a FLAC file may carry one too).
fn skip_id3v2(mut bytes: &[u8]) -> Result<(&[u8], AudioFormat), String> {
    while let [b'I', b'D', b'3', _, _, flags, size @ ..] = bytes {
        let Some(size) = size.get(..4) else {
            return Err("the ID3v2 tag header is truncated".into());
        };
        if size.iter().any(|b| b & 0x80 != 0) {
            return Err("the ID3v2 tag's size is not a sync-safe integer".into());
        }
        let size = size
            .iter()
            .fold(0usize, |acc, &b| acc << 7 | usize::from(b));
        let footer = if flags & 0x10 != 0 { 10 } else { 0 };
        let total = 10 + size + footer;
        if total > bytes.len() {
            return Err(format!(
                "the ID3v2 tag declares {size} bytes but {} follow",
                bytes.len() - 10
            ));
        }
        bytes = &bytes[total..];
    }
    let format = AudioFormat::sniff(bytes)
        .map_err(|_| "no MP3, FLAC, WAV or Ogg data follows the ID3v2 tag".to_string())?;
    Ok((bytes, format))
}

/// RIFF chunks before `data` fit in the file, and `fmt ` declares channels, a frame size
/// and a sample size.
fn check_wav(bytes: &[u8]) -> Result<(), String> {
    let mut at = 12;
    while let Some(header) = bytes.get(at..at + 8) {
        let tag = &header[..4];
        let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
        if tag == b"data" {
            // The data's length is checked against what decodes (a truncated file is
            // refused); symphonia reads it in packets of bounded size.
            return Ok(());
        }
        let body = &bytes[at + 8..];
        let chunk = body.get(..len).ok_or_else(|| {
            format!(
                "the WAV '{}' chunk declares {len} bytes but {} follow",
                String::from_utf8_lossy(tag),
                body.len()
            )
        })?;
        if tag == b"fmt " {
            check_wav_format(chunk)?;
        }
        at += 8 + len + (len & 1);
    }
    Ok(())
}

fn check_wav_format(fmt: &[u8]) -> Result<(), String> {
    let Some(fields) = fmt.get(..16) else {
        return Err(format!(
            "the WAV 'fmt ' chunk is {} bytes, fewer than 16",
            fmt.len()
        ));
    };
    let u16_at = |i: usize| u16::from_le_bytes([fields[i], fields[i + 1]]);
    let (tag, channels, block_align, bits) = (u16_at(0), u16_at(2), u16_at(12), u16_at(14));
    if fields[4..8] == [0; 4] {
        return Err("the WAV format declares a sample rate of 0 Hz".into());
    }
    if channels == 0 {
        return Err("the WAV format declares 0 channels".into());
    }
    if block_align == 0 {
        return Err("the WAV format declares 0 bytes per frame".into());
    }
    // PCM, IEEE float and the extensible form carry plain samples, which have a size.
    if matches!(tag, 1 | 3 | 0xFFFE) && bits == 0 {
        return Err("the WAV format declares 0 bits per sample".into());
    }
    Ok(())
}

/// FLAC metadata blocks fit in the file, and so do a comment block's strings and a picture
/// block's fields.
fn check_flac(bytes: &[u8]) -> Result<(), String> {
    let mut at = 4;
    while let Some(&[kind, a, b, c]) = bytes.get(at..at + 4) {
        let len = u32::from_be_bytes([0, a, b, c]) as usize;
        let body = &bytes[at + 4..];
        let block = body.get(..len).ok_or_else(|| {
            format!(
                "a FLAC metadata block declares {len} bytes but {} follow",
                body.len()
            )
        })?;
        check_flac_block(kind & 0x7F, block)?;
        if kind & 0x80 != 0 {
            break;
        }
        at += 4 + len;
    }
    Ok(())
}

/// A FLAC metadata block's inner sizes (in a FLAC file or an Ogg FLAC header packet).
fn check_flac_block(kind: u8, block: &[u8]) -> Result<(), String> {
    match kind {
        4 => check_comments(block),
        6 => check_picture(block),
        _ => Ok(()),
    }
}

/// A Vorbis comment list (no framing bit): vendor string, count, strings.
fn check_comments(data: &[u8]) -> Result<(), String> {
    let mut reader = Bytes { data, at: 0 };
    let vendor = reader.u32_le()?;
    reader.skip(vendor, "the comment vendor string")?;
    let count = reader.u32_le()?;
    for _ in 0..count {
        let len = reader.u32_le()?;
        reader.skip(len, "a comment")?;
    }
    Ok(())
}

/// A FLAC picture: type, media type, description, four numbers, data.
fn check_picture(data: &[u8]) -> Result<(), String> {
    let mut reader = Bytes { data, at: 0 };
    reader.u32_be()?;
    let media_type = reader.u32_be()?;
    reader.skip(media_type, "the picture's media type")?;
    let description = reader.u32_be()?;
    reader.skip(description, "the picture's description")?;
    for _ in 0..4 {
        reader.u32_be()?;
    }
    let len = reader.u32_be()?;
    reader.skip(len, "the picture")
}

/// A byte cursor whose every declared size must fit.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let out = self
            .data
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| "a metadata block is truncated".to_string())?;
        self.at += n;
        Ok(out)
    }

    fn u32_le(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u32_be(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn skip(&mut self, declared: u32, what: &str) -> Result<(), String> {
        let left = self.data.len() - self.at;
        if declared as usize > left {
            return Err(format!(
                "{what} declares {declared} bytes but {left} remain in its block"
            ));
        }
        self.at += declared as usize;
        Ok(())
    }
}

/// The codec a logical Ogg stream carries, from its first packet.
#[derive(Clone, Copy, PartialEq)]
enum OggCodec {
    Vorbis,
    Opus,
    /// FLAC with this many header packets after the first.
    Flac(usize),
    Other,
}

/// A logical Ogg stream while its header packets are read.
struct OggStream {
    codec: OggCodec,
    packets: usize,
    partial: Vec<u8>,
}

impl OggStream {
    /// Whether packet number `packets` is still a header.
    fn in_headers(&self) -> bool {
        match self.codec {
            OggCodec::Vorbis => self.packets < 3,
            OggCodec::Opus => self.packets < 2,
            OggCodec::Flac(n) => self.packets <= n,
            OggCodec::Other => self.packets == 0,
        }
    }
}

/// The header packets of every logical Ogg stream: comment lists, FLAC pictures and the
/// Vorbis codebooks.
fn check_ogg(bytes: &[u8]) -> Result<(), String> {
    let mut streams: HashMap<u32, OggStream> = HashMap::new();
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 27) {
        if &header[..4] != b"OggS" {
            break;
        }
        let serial = u32::from_le_bytes([header[14], header[15], header[16], header[17]]);
        let segments = usize::from(header[26]);
        let Some(lacing) = bytes.get(at + 27..at + 27 + segments) else {
            break;
        };
        let mut data = at + 27 + segments;
        if !streams.contains_key(&serial) && streams.len() == MAX_OGG_STREAMS {
            return Err(format!(
                "the Ogg file holds more than {MAX_OGG_STREAMS} logical streams"
            ));
        }
        let stream = streams.entry(serial).or_insert(OggStream {
            codec: OggCodec::Other,
            packets: 0,
            partial: Vec::new(),
        });
        for &lace in lacing {
            let Some(segment) = bytes.get(data..data + usize::from(lace)) else {
                // A truncated page: symphonia reports it.
                return Ok(());
            };
            data += usize::from(lace);
            if !stream.in_headers() {
                continue;
            }
            stream.partial.extend_from_slice(segment);
            if lace < 255 {
                let packet = std::mem::take(&mut stream.partial);
                if stream.packets == 0 {
                    stream.codec = match packet.as_slice() {
                        [1, b'v', b'o', b'r', b'b', b'i', b's', ..] => OggCodec::Vorbis,
                        [b'O', b'p', b'u', b's', b'H', b'e', b'a', b'd', ..] => OggCodec::Opus,
                        [0x7F, b'F', b'L', b'A', b'C', _, _, hi, lo, ..] => {
                            OggCodec::Flac(usize::from(u16::from_be_bytes([*hi, *lo])))
                        }
                        _ => OggCodec::Other,
                    };
                } else {
                    check_ogg_header(stream.codec, &packet)?;
                }
                stream.packets += 1;
            }
        }
        at = data;
    }
    Ok(())
}

fn check_ogg_header(codec: OggCodec, packet: &[u8]) -> Result<(), String> {
    match (codec, packet) {
        (OggCodec::Vorbis, [3, b'v', b'o', b'r', b'b', b'i', b's', rest @ ..]) => {
            check_comments(rest)
        }
        (OggCodec::Vorbis, [5, b'v', b'o', b'r', b'b', b'i', b's', rest @ ..]) => {
            check_vorbis_codebooks(rest)
        }
        (OggCodec::Opus, [b'O', b'p', b'u', b's', b'T', b'a', b'g', b's', rest @ ..]) => {
            check_comments(rest)
        }
        (OggCodec::Flac(_), [kind, _, _, _, block @ ..]) => check_flac_block(kind & 0x7F, block),
        _ => Ok(()),
    }
}

/// The codebooks at the start of a Vorbis setup header (Vorbis I §3.2.1): each declares its
/// entries and dimensions, and a lookup table of `entries × dimensions` values is built from
/// them before anything else is checked.
fn check_vorbis_codebooks(setup: &[u8]) -> Result<(), String> {
    let mut bits = Bits { data: setup, at: 0 };
    let truncated = |_| "the Vorbis setup header is truncated".to_string();
    let count = bits.read(8).map_err(truncated)? + 1;
    for book in 0..count {
        if bits.read(24).map_err(truncated)? != 0x0056_4342 {
            return Err(format!("Vorbis codebook {book} has no sync pattern"));
        }
        let dimensions = u64::from(bits.read(16).map_err(truncated)?);
        let entries = u64::from(bits.read(24).map_err(truncated)?);
        if entries > MAX_CODEBOOK_ENTRIES {
            return Err(format!(
                "Vorbis codebook {book} declares {entries} entries, more than {MAX_CODEBOOK_ENTRIES}"
            ));
        }
        if bits.read(1).map_err(truncated)? == 0 {
            let sparse = bits.read(1).map_err(truncated)? == 1;
            for _ in 0..entries {
                if !sparse || bits.read(1).map_err(truncated)? == 1 {
                    bits.read(5).map_err(truncated)?;
                }
            }
        } else {
            let mut length = bits.read(5).map_err(truncated)? + 1;
            let mut entry = 0u64;
            while entry < entries {
                entry += u64::from(bits.read(ilog(entries - entry)).map_err(truncated)?);
                length += 1;
                if entry > entries || length > 33 {
                    return Err(format!("Vorbis codebook {book} has invalid lengths"));
                }
            }
        }
        match bits.read(4).map_err(truncated)? {
            0 => {}
            lookup @ (1 | 2) => {
                bits.read(32).map_err(truncated)?;
                bits.read(32).map_err(truncated)?;
                let value_bits = u64::from(bits.read(4).map_err(truncated)? + 1);
                bits.read(1).map_err(truncated)?;
                let values = entries * dimensions;
                if dimensions == 0 || values > MAX_CODEBOOK_VALUES {
                    return Err(format!(
                        "Vorbis codebook {book} declares a lookup table of {entries} entries × \
                         {dimensions} dimensions (1..={MAX_CODEBOOK_VALUES} values are read)"
                    ));
                }
                let multiplicands = if lookup == 1 {
                    lookup1_values(entries, dimensions)
                } else {
                    values
                };
                bits.skip(multiplicands * value_bits).map_err(truncated)?;
            }
            other => return Err(format!("Vorbis codebook {book} has lookup type {other}")),
        }
    }
    Ok(())
}

/// The largest `v` with `v^dimensions ≤ entries` (Vorbis I §9.2.3).
fn lookup1_values(entries: u64, dimensions: u64) -> u64 {
    let fits = |v: u64| {
        (0..dimensions)
            .try_fold(1u64, |acc, _| acc.checked_mul(v).filter(|&p| p <= entries))
            .is_some()
    };
    let mut v = (entries as f64).powf(1.0 / dimensions as f64).floor() as u64;
    while v > 0 && !fits(v) {
        v -= 1;
    }
    while fits(v + 1) {
        v += 1;
    }
    v
}

/// Bits needed to write `x` (Vorbis' `ilog`).
fn ilog(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// A reader of bits, least significant first (Vorbis' packing).
struct Bits<'a> {
    data: &'a [u8],
    /// Bit position.
    at: u64,
}

impl Bits<'_> {
    fn read(&mut self, n: u32) -> Result<u32, ()> {
        let mut value = 0u32;
        for i in 0..n {
            let byte = *self.data.get((self.at / 8) as usize).ok_or(())?;
            value |= u32::from((byte >> (self.at % 8)) & 1) << i;
            self.at += 1;
        }
        Ok(value)
    }

    fn skip(&mut self, n: u64) -> Result<(), ()> {
        let end = self.at.checked_add(n).ok_or(())?;
        if end > self.data.len() as u64 * 8 {
            return Err(());
        }
        self.at = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup1_values_is_the_integer_root() {
        assert_eq!(lookup1_values(81, 4), 3);
        assert_eq!(lookup1_values(80, 4), 2);
        assert_eq!(lookup1_values(1 << 20, 1), 1 << 20);
        assert_eq!(lookup1_values(5, 65535), 1);
    }

    #[test]
    fn bits_read_least_significant_first() {
        let mut bits = Bits {
            data: &[0b1010_0110, 0xFF],
            at: 0,
        };
        assert_eq!(bits.read(3), Ok(0b110));
        assert_eq!(bits.read(5), Ok(0b10100));
        assert_eq!(bits.read(8), Ok(0xFF));
        assert_eq!(bits.read(1), Err(()));
    }
}
