//! Hostile and broken inputs: clean errors naming what was wrong, never a panic.
use std::path::PathBuf;

use wick_media::{
    decode_audio, decode_image, prepare_audio, probe_image, AudioLimits, ImageLimits,
    ImageProcessor, MediaError, MelConfig, RgbImage,
};

fn read(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    std::fs::read(path).unwrap()
}

#[test]
fn truncated_images_are_decode_errors() {
    for name in [
        "alpha.png",
        "exif_rotated.jpg",
        "lossless.webp",
        "two_frames.gif",
        "plain.bmp",
        "plain.tiff",
    ] {
        let bytes = read(name);
        for cut in [bytes.len() / 2, 40, 12] {
            match decode_image(&bytes[..cut], &ImageLimits::default()) {
                Err(MediaError::Decode { .. } | MediaError::UnknownFormat { .. }) => {}
                // The first of two GIF frames is complete in the first half, as Pillow reads it.
                Ok(_) if name.ends_with(".gif") && cut == bytes.len() / 2 => {}
                other => panic!(
                    "{name} cut at {cut}: {:?}",
                    other.map(|i| (i.width, i.height))
                ),
            }
        }
    }
}

/// A PNG's signature and header for `width × height` RGB pixels, then (with `garbage`) an
/// `IDAT` chunk that is not compressed data and the end chunk.
fn png_header(width: u32, height: u32, garbage: bool) -> Vec<u8> {
    let chunk = |out: &mut Vec<u8>, tag: &[u8], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = tag.to_vec();
        body.extend_from_slice(data);
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut out, b"IHDR", &ihdr);
    if garbage {
        chunk(&mut out, b"IDAT", b"not zlib at all, and not pixels");
        chunk(&mut out, b"IEND", b"");
    }
    out
}

#[test]
fn huge_declared_dimensions_are_refused_before_decoding() {
    // A PNG header declaring 100000 × 100000 pixels, with no data behind it: the error
    // reports the size (it said 0×0).
    let err = decode_image(
        &png_header(100_000, 100_000, false),
        &ImageLimits::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            MediaError::TooManyPixels {
                width: 100_000,
                height: 100_000,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("100000×100000 pixels"), "{err}");
    // A GIF's logical screen and a BMP's header, over the side limit.
    let mut gif = b"GIF89a".to_vec();
    gif.extend_from_slice(&60_000u16.to_le_bytes());
    gif.extend_from_slice(&10u16.to_le_bytes());
    // No global palette; one 1×1 frame; the trailer.
    gif.extend_from_slice(&[0, 0, 0]);
    gif.extend_from_slice(&[0x2C, 0, 0, 0, 0, 1, 0, 1, 0, 0, 2, 2, 0x4C, 0x01, 0, 0x3B]);
    let mut bmp = bmp_header(9000, 2);
    bmp.extend_from_slice(&[0; 64]);
    for (name, bytes, size) in [("GIF", gif, "60000×10"), ("BMP", bmp, "9000×2")] {
        let err = probe_image(&bytes, &ImageLimits::default()).unwrap_err();
        assert!(
            matches!(err, MediaError::TooManyPixels { .. })
                && err.to_string().contains(&format!("{size} pixels")),
            "{name}: {err}"
        );
    }

    // Within the side limit but over the pixel budget.
    let limits = ImageLimits {
        max_pixels: 1000,
        ..ImageLimits::default()
    };
    let err = decode_image(&read("alpha.png"), &limits).unwrap_err();
    assert!(
        matches!(
            err,
            MediaError::TooManyPixels {
                width: 61,
                height: 47,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn oversize_and_empty_inputs_are_refused() {
    let limits = ImageLimits {
        max_bytes: 100,
        ..ImageLimits::default()
    };
    assert!(matches!(
        decode_image(&read("alpha.png"), &limits),
        Err(MediaError::TooLarge { .. })
    ));
    assert!(matches!(
        decode_image(&[], &ImageLimits::default()),
        Err(MediaError::Empty { .. })
    ));
    let err = decode_image(b"<html>not an image</html>", &ImageLimits::default()).unwrap_err();
    assert!(
        err.to_string().contains("unrecognized image format"),
        "{err}"
    );
}

#[test]
fn audio_garbage_and_truncation() {
    let err = decode_audio(b"hello world, not audio", &AudioLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::UnknownFormat { .. }), "{err:?}");
    let wav = read("mono16k.wav");
    assert!(decode_audio(&wav[..30], &AudioLimits::default()).is_err());
    // A clip longer than the limit is cut, and says so.
    let limits = AudioLimits {
        max_seconds: 0.5,
        ..AudioLimits::default()
    };
    let clip = decode_audio(&wav, &limits).unwrap();
    assert!(clip.truncated);
    assert_eq!(clip.samples.len(), 8000);
}

/// A file cut short (a partial upload) is refused in every container, not heard in part;
/// the complete files decode to the whole clip.
#[test]
fn audio_cut_short_is_a_decode_error() {
    for name in ["mono16k.wav", "mono16k.flac", "mono16k.mp3", "mono16k.ogg"] {
        let bytes = read(name);
        let clip =
            decode_audio(&bytes, &AudioLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!clip.truncated, "{name}");
        assert!(
            clip.samples.len() >= 20_800,
            "{name}: {}",
            clip.samples.len()
        );
        for percent in [50, 90, 95] {
            let cut = &bytes[..bytes.len() * percent / 100];
            // (An Ogg cut in half already fails in the container reader: "end of stream".)
            let result = decode_audio(cut, &AudioLimits::default());
            assert!(
                matches!(result, Err(MediaError::Decode { .. })),
                "{name} cut to {percent}%: {result:?}"
            );
        }
    }
}

#[test]
fn random_bytes_after_valid_signatures_never_panic() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    let heads: [&[u8]; 6] = [
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff\xe0",
        b"RIFF\0\0\0\0WEBPVP8 ",
        b"GIF89a",
        b"BM",
        b"II*\0",
    ];
    for head in heads {
        for _ in 0..20 {
            let mut bytes = head.to_vec();
            bytes.extend((0..200).map(|_| next()));
            let _ = decode_image(&bytes, &ImageLimits::default());
        }
    }
    for head in [&b"RIFF\0\0\0\0WAVEfmt "[..], b"fLaC", b"OggS", b"ID3"] {
        for _ in 0..20 {
            let mut bytes = head.to_vec();
            bytes.extend((0..300).map(|_| next()));
            let _ = decode_audio(&bytes, &AudioLimits::default());
        }
    }
}

/// A 24-bit BMP's headers for `width × height` pixels (the pixel rows are the caller's).
fn bmp_header(width: i32, height: i32) -> Vec<u8> {
    let mut bmp = b"BM".to_vec();
    bmp.extend_from_slice(&(54u32 + 64).to_le_bytes());
    bmp.extend_from_slice(&[0; 4]);
    bmp.extend_from_slice(&54u32.to_le_bytes());
    bmp.extend_from_slice(&40u32.to_le_bytes());
    bmp.extend_from_slice(&width.to_le_bytes());
    bmp.extend_from_slice(&height.to_le_bytes());
    bmp.extend_from_slice(&1u16.to_le_bytes());
    bmp.extend_from_slice(&24u16.to_le_bytes());
    bmp.extend_from_slice(&[0; 24]);
    bmp
}

/// An image with no pixels is refused by the decoder and by every processor (a 0-wide image
/// made the bilinear resize panic on a zero row stride).
#[test]
fn empty_images_are_refused() {
    let err = decode_image(&png_header(0, 4, true), &ImageLimits::default()).unwrap_err();
    assert!(err.to_string().contains("declares a 0×4 image"), "{err}");
    let mut bmp = bmp_header(0, 4);
    bmp.extend_from_slice(&[0; 64]);
    assert!(matches!(
        decode_image(&bmp, &ImageLimits::default()),
        Err(MediaError::Decode { .. })
    ));
    let empty = RgbImage {
        width: 0,
        height: 3,
        data: Vec::new(),
    };
    for processor in [
        ImageProcessor::Gemma3 { size: 8 },
        ImageProcessor::Gemma4 {
            patch: 4,
            pool: 3,
            max_patches: 630,
        },
        qwen([0.5; 3], [0.5; 3]),
    ] {
        let err = processor.process(&empty).unwrap_err();
        assert!(
            matches!(err, MediaError::Processor(_)),
            "{processor:?}: {err}"
        );
    }
}

fn qwen(mean: [f32; 3], std: [f32; 3]) -> ImageProcessor {
    ImageProcessor::Qwen {
        patch: 8,
        merge: 2,
        min_pixels: 1024,
        max_pixels: 4096,
        mean,
        std,
    }
}

/// A processor's settings come from the model's config: a zero or subnormal standard
/// deviation made every pixel infinite, a huge size allocated gigabytes per image.
#[test]
fn processor_settings_are_checked() {
    let image = decode_image(&read("alpha.png"), &ImageLimits::default()).unwrap();
    assert!(qwen([0.5; 3], [0.5; 3]).process(&image).is_ok());
    for processor in [
        qwen([0.5; 3], [0.0; 3]),
        qwen([0.5; 3], [1e-40; 3]),
        qwen([0.5, f32::NAN, 0.5], [0.5; 3]),
        qwen([0.5; 3], [0.5, f32::INFINITY, 0.5]),
        ImageProcessor::Gemma3 { size: 0 },
        ImageProcessor::Gemma3 { size: 100_000 },
        ImageProcessor::Gemma4 {
            patch: 16,
            pool: 0,
            max_patches: 630,
        },
    ] {
        let err = processor.process(&image).unwrap_err();
        assert!(matches!(err, MediaError::Config(_)), "{processor:?}: {err}");
    }
}

/// The header tells what an image costs without decoding it: an 8000×5000 PNG whose pixel
/// data is missing is sized (and would be refused by a token budget) all the same.
#[test]
fn the_header_alone_gives_the_size_and_the_soft_tokens() {
    let png = png_header(8000, 5000, true);
    let header = probe_image(&png, &ImageLimits::default()).unwrap();
    assert_eq!((header.width, header.height), (8000, 5000));
    assert!(matches!(
        decode_image(&png, &ImageLimits::default()),
        Err(MediaError::Decode { .. })
    ));
    let processor = ImageProcessor::Qwen {
        patch: 14,
        merge: 2,
        min_pixels: 3136,
        max_pixels: 12_845_056,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    let layout = processor.layout(8000, 5000).unwrap();
    // transformers' smart_resize: 2828×4508 pixels, 101 × 161 windows of 28 px.
    assert_eq!((layout.height, layout.width), (2828, 4508));
    assert_eq!(layout.soft_tokens, Some(16_261));
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A RIFF WAVE file: a 16-byte `fmt ` chunk, `chunks` before the data, `data` last.
struct Wav {
    format: u16,
    channels: u16,
    rate: u32,
    block_align: u16,
    bits: u16,
    chunks: Vec<([u8; 4], Vec<u8>)>,
    data: Vec<u8>,
}

impl Wav {
    /// 16-bit mono PCM at `rate` Hz: `samples` of a 440 Hz tone.
    fn pcm(rate: u32, samples: usize) -> Wav {
        let data = (0..samples)
            .flat_map(|i| {
                let t = i as f64 / f64::from(rate);
                (((2.0 * std::f64::consts::PI * 440.0 * t).sin() * 8000.0) as i16).to_le_bytes()
            })
            .collect();
        Wav {
            format: 1,
            channels: 1,
            rate,
            block_align: 2,
            bits: 16,
            chunks: Vec::new(),
            data,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut fmt = Vec::new();
        fmt.extend_from_slice(&self.format.to_le_bytes());
        fmt.extend_from_slice(&self.channels.to_le_bytes());
        fmt.extend_from_slice(&self.rate.to_le_bytes());
        let byte_rate = self.rate.wrapping_mul(u32::from(self.block_align));
        fmt.extend_from_slice(&byte_rate.to_le_bytes());
        fmt.extend_from_slice(&self.block_align.to_le_bytes());
        fmt.extend_from_slice(&self.bits.to_le_bytes());
        let mut body = b"WAVE".to_vec();
        let mut chunk = |tag: &[u8], payload: &[u8], declared: u32| {
            body.extend_from_slice(tag);
            body.extend_from_slice(&declared.to_le_bytes());
            body.extend_from_slice(payload);
            if payload.len() % 2 == 1 {
                body.push(0);
            }
        };
        chunk(b"fmt ", &fmt, 16);
        for (tag, payload) in &self.chunks {
            // A chunk whose payload is empty declares 4 GB: its size is a lie.
            let declared = if payload.is_empty() {
                u32::MAX - 64
            } else {
                payload.len() as u32
            };
            chunk(tag, payload, declared);
        }
        chunk(b"data", &self.data, self.data.len() as u32);
        let mut out = b"RIFF".to_vec();
        // A RIFF size of 4 GB, as a streamed file writes: only the chunks' own sizes bound them.
        out.extend_from_slice(&u32::MAX.to_le_bytes());
        out.extend_from_slice(&body);
        out
    }
}

/// The header's sample rate sizes the resampler and the samples kept: one from 1 GHz used to
/// build a 1.5 TB filter table (the allocation failed and the process aborted), one at
/// 999,999 Hz cost seconds of CPU and 1.5 GB for a 5 KB clip. Rates outside the limits are
/// refused; odd rates inside them resample in bounded memory.
#[test]
fn sample_rates_are_checked_before_anything_is_sized_by_them() {
    for rate in [999_999_999, 999_999, 999, 0] {
        let wav = Wav::pcm(rate, 2000).bytes();
        let err = prepare_audio(&wav, &AudioLimits::default(), &MelConfig::default())
            .expect_err("refused");
        if rate == 0 {
            assert!(matches!(err, MediaError::Decode { .. }), "{rate}: {err:?}");
        } else {
            assert_eq!(
                err,
                MediaError::SampleRate {
                    rate,
                    min: 1_000,
                    max: 192_000
                }
            );
        }
    }
    // A prime rate (as many filter phases as the target rate) and the highest rate read
    // give half a second's features, as the same clip at 16 kHz does.
    let prepare = |rate: u32| {
        let wav = Wav::pcm(rate, rate as usize / 2).bytes();
        prepare_audio(&wav, &AudioLimits::default(), &MelConfig::default()).unwrap()
    };
    let at_16k = prepare(16_000);
    for rate in [44_101, 192_000] {
        let prepared = prepare(rate);
        assert_eq!(prepared.soft_tokens, at_16k.soft_tokens, "{rate}");
        assert_eq!(prepared.features.frames, at_16k.features.frames, "{rate}");
    }
}

/// What a case expects in the error, and how it breaks a good file.
type Breakage = (&'static str, fn(&mut Wav));

#[test]
fn wav_format_and_chunk_sizes_are_checked() {
    let cases: [Breakage; 5] = [
        ("0 channels", |w| w.channels = 0),
        ("0 bytes per frame", |w| w.block_align = 0),
        ("0 bits per sample", |w| w.bits = 0),
        ("'LIST' chunk declares", |w| {
            w.chunks.push((*b"LIST", Vec::new()))
        }),
        ("'junk' chunk declares", |w| {
            w.chunks.push((*b"junk", Vec::new()))
        }),
    ];
    for (want, break_it) in cases {
        let mut wav = Wav::pcm(16_000, 1600);
        break_it(&mut wav);
        let err = decode_audio(&wav.bytes(), &AudioLimits::default()).unwrap_err();
        assert!(
            matches!(err, MediaError::Decode { .. }) && err.to_string().contains(want),
            "{want}: {err}"
        );
    }
    // A LIST chunk that fits is read past.
    let mut wav = Wav::pcm(16_000, 1600);
    wav.chunks
        .push((*b"LIST", b"INFOINAM\x05\0\0\0wick\0\0".to_vec()));
    assert_eq!(
        decode_audio(&wav.bytes(), &AudioLimits::default())
            .unwrap()
            .samples
            .len(),
        1600
    );
}

/// FLAC metadata: a comment or picture declaring more bytes than its block holds (symphonia
/// allocated the declared size first).
#[test]
fn flac_metadata_sizes_are_checked() {
    let flac = read("mono16k.flac");
    // STREAMINFO is the first block (34 bytes); splice a block after it.
    let streaminfo_end = 4 + 4 + 34;
    let with_block = |kind: u8, block: &[u8]| {
        let mut out = flac[..streaminfo_end].to_vec();
        // STREAMINFO is no longer last.
        out[4] &= 0x7F;
        out.push(kind);
        out.extend_from_slice(&(block.len() as u32).to_be_bytes()[1..]);
        out.extend_from_slice(block);
        let mut rest = flac[streaminfo_end..].to_vec();
        if flac[4] & 0x80 != 0 {
            // STREAMINFO was the only block: the spliced one is now last.
            let at = streaminfo_end;
            out[at] |= 0x80;
        }
        out.append(&mut rest);
        out
    };
    let mut comment = Vec::new();
    comment.extend_from_slice(&4u32.to_le_bytes());
    comment.extend_from_slice(b"wick");
    comment.extend_from_slice(&1u32.to_le_bytes());
    comment.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    comment.extend_from_slice(b"TITLE=x");
    let err = decode_audio(&with_block(4, &comment), &AudioLimits::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("a comment declares 4294967280 bytes"),
        "{err}"
    );
    let mut picture = Vec::new();
    picture.extend_from_slice(&3u32.to_be_bytes());
    picture.extend_from_slice(&9u32.to_be_bytes());
    picture.extend_from_slice(b"image/png");
    picture.extend_from_slice(&0u32.to_be_bytes());
    picture.extend_from_slice(&[0; 16]);
    picture.extend_from_slice(&0x7FFF_FFFFu32.to_be_bytes());
    let err = decode_audio(&with_block(6, &picture), &AudioLimits::default()).unwrap_err();
    assert!(err.to_string().contains("the picture declares"), "{err}");
    // A well-formed comment block is read past.
    let mut comment = Vec::new();
    comment.extend_from_slice(&4u32.to_le_bytes());
    comment.extend_from_slice(b"wick");
    comment.extend_from_slice(&1u32.to_le_bytes());
    comment.extend_from_slice(&7u32.to_le_bytes());
    comment.extend_from_slice(b"TITLE=x");
    assert!(decode_audio(&with_block(4, &comment), &AudioLimits::default()).is_ok());
}

/// An ID3v2 tag carries no audio; its frames declare sizes symphonia allocated first (4 GB
/// for a v2.3 frame). The tag is skipped; one longer than the file is refused.
#[test]
fn id3v2_tags_are_skipped_not_parsed() {
    let mp3 = read("mono16k.mp3");
    let mut frame = b"TIT2".to_vec();
    frame.extend_from_slice(&0xFFFF_FFF0u32.to_be_bytes());
    frame.extend_from_slice(&[0, 0, 0, b'x']);
    let mut tagged = b"ID3\x03\x00\x00".to_vec();
    let size = frame.len() as u32;
    tagged.extend((0..4).rev().map(|i| ((size >> (7 * i)) & 0x7F) as u8));
    tagged.extend_from_slice(&frame);
    tagged.extend_from_slice(&mp3);
    let plain = decode_audio(&mp3, &AudioLimits::default()).unwrap();
    let clip = decode_audio(&tagged, &AudioLimits::default()).unwrap();
    assert_eq!(clip.samples.len(), plain.samples.len());

    let mut cut = tagged[..10].to_vec();
    cut[9] = 0x7F;
    let err = decode_audio(&cut, &AudioLimits::default()).unwrap_err();
    assert!(err.to_string().contains("ID3v2 tag declares"), "{err}");
}

/// An Ogg page holding whole `packets` (none continued), with its CRC.
fn ogg_page(serial: u32, sequence: u32, kind: u8, packets: &[&[u8]]) -> Vec<u8> {
    let mut lacing = Vec::new();
    for p in packets {
        lacing.extend(std::iter::repeat_n(255u8, p.len() / 255));
        lacing.push((p.len() % 255) as u8);
    }
    let mut page = b"OggS\0".to_vec();
    page.push(kind);
    page.extend_from_slice(&0u64.to_le_bytes());
    page.extend_from_slice(&serial.to_le_bytes());
    page.extend_from_slice(&sequence.to_le_bytes());
    page.extend_from_slice(&[0; 4]);
    page.push(lacing.len() as u8);
    page.extend_from_slice(&lacing);
    for p in packets {
        page.extend_from_slice(p);
    }
    let crc = page.iter().fold(0u32, |crc, &b| {
        (0..8).fold(crc ^ (u32::from(b) << 24), |c, _| {
            if c & 0x8000_0000 != 0 {
                (c << 1) ^ 0x04C1_1DB7
            } else {
                c << 1
            }
        })
    });
    page[22..26].copy_from_slice(&crc.to_le_bytes());
    page
}

/// Bits written least significant first (Vorbis' packing).
#[derive(Default)]
struct BitWriter {
    bytes: Vec<u8>,
    bits: usize,
}

impl BitWriter {
    fn put(&mut self, value: u64, n: usize) {
        for i in 0..n {
            if self.bits.is_multiple_of(8) {
                self.bytes.push(0);
            }
            if (value >> i) & 1 == 1 {
                *self.bytes.last_mut().unwrap() |= 1 << (self.bits % 8);
            }
            self.bits += 1;
        }
    }
}

/// The three header packets of a mono 16 kHz Ogg Vorbis stream whose setup header holds one
/// codebook of `entries` (a complete code: `entries` is a power of two, every code as long)
/// and `dimensions`, with lookup table type `lookup`; the rest of the setup is left out.
fn vorbis_headers(entries: u64, dimensions: u64, lookup: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let mut ident = b"\x01vorbis".to_vec();
    ident.extend_from_slice(&0u32.to_le_bytes());
    ident.push(1);
    ident.extend_from_slice(&16_000u32.to_le_bytes());
    ident.extend_from_slice(&[0; 12]);
    ident.push(0xB8); // block sizes 2^8 and 2^11
    ident.push(1);
    let mut comment = b"\x03vorbis".to_vec();
    comment.extend_from_slice(&0u32.to_le_bytes());
    comment.extend_from_slice(&0u32.to_le_bytes());
    comment.push(1);
    let length = u64::from(entries.trailing_zeros());
    let mut setup = BitWriter::default();
    setup.put(0, 8); // one codebook
    setup.put(0x56_4342, 24);
    setup.put(dimensions, 16);
    setup.put(entries, 24);
    setup.put(1, 1); // ordered
    setup.put(length - 1, 5); // the first (and only) length
    setup.put(entries, 64 - entries.leading_zeros() as usize); // every entry has it
    setup.put(lookup, 4);
    setup.put(0, 32);
    setup.put(0, 32);
    setup.put(0, 4); // 1 bit per value
    setup.put(0, 1);
    setup.put(0, 64); // a few multiplicands
    let mut setup_packet = b"\x05vorbis".to_vec();
    setup_packet.extend_from_slice(&setup.bytes);
    (ident, comment, setup_packet)
}

fn ogg_vorbis(headers: &(Vec<u8>, Vec<u8>, Vec<u8>)) -> Vec<u8> {
    let (ident, comment, setup) = headers;
    let mut ogg = ogg_page(7, 0, 2, &[ident]);
    ogg.extend(ogg_page(7, 1, 0, &[comment, setup]));
    ogg.extend(ogg_page(7, 2, 4, &[&[0u8; 8]]));
    ogg
}

/// A Vorbis codebook's lookup table holds entries × dimensions floats, allocated by
/// symphonia as soon as they are read: 2^21 entries × 4096 dimensions with lookup type 2
/// (whose value count, a 32-bit product, wraps to 0, so nothing else is read first) asked for
/// 32 GB from a 100-byte file, and the failed allocation aborted the process.
#[test]
fn a_vorbis_codebook_lookup_table_is_bounded() {
    let err = decode_audio(
        &ogg_vorbis(&vorbis_headers(1 << 21, 1 << 12, 2)),
        &AudioLimits::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("2097152 entries, more than 1048576"),
        "{err}"
    );
    let err = decode_audio(
        &ogg_vorbis(&vorbis_headers(1 << 20, 65_535, 1)),
        &AudioLimits::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("1048576 entries × 65535 dimensions"),
        "{err}"
    );
    // A comment in the same stream declaring 4 GB.
    let (ident, _, setup) = vorbis_headers(1 << 4, 2, 1);
    let mut comment = b"\x03vorbis".to_vec();
    comment.extend_from_slice(&0u32.to_le_bytes());
    comment.extend_from_slice(&1u32.to_le_bytes());
    comment.extend_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    let err = decode_audio(
        &ogg_vorbis(&(ident, comment, setup)),
        &AudioLimits::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("a comment declares"), "{err}");
}

/// Each new serial number opens a logical stream; thousands of one-page streams are refused
/// before they are tracked (each cost a search of the others).
#[test]
fn an_ogg_file_with_thousands_of_streams_is_refused() {
    let headers = vorbis_headers(1 << 4, 2, 1);
    let mut ogg = Vec::new();
    for serial in 0..5000 {
        ogg.extend(ogg_page(serial, 0, 2, &[&headers.0]));
    }
    let err = decode_audio(&ogg, &AudioLimits::default()).unwrap_err();
    assert!(
        err.to_string().contains("more than 64 logical streams"),
        "{err}"
    );
}

#[test]
fn the_real_ogg_vorbis_clip_passes_the_header_checks() {
    let clip = decode_audio(&read("mono16k.ogg"), &AudioLimits::default()).unwrap();
    assert!(clip.samples.len() > 20_000);
}
