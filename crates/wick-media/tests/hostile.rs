//! Hostile and broken inputs: clean errors naming what was wrong, never a panic.
use std::path::PathBuf;

use wick_media::{decode_audio, decode_image, AudioLimits, ImageLimits, MediaError};

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

#[test]
fn huge_declared_dimensions_are_refused_before_decoding() {
    // A PNG header declaring 100000 × 100000 pixels, with no data behind it.
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend_from_slice(&100_000u32.to_be_bytes());
    ihdr.extend_from_slice(&100_000u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png.extend_from_slice(&13u32.to_be_bytes());
    png.extend_from_slice(&ihdr);
    png.extend_from_slice(&crc32(&ihdr).to_be_bytes());
    let err = decode_image(&png, &ImageLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::TooManyPixels { .. }), "{err:?}");

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
