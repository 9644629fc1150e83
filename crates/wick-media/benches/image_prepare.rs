//! A 1-megapixel JPEG decoded and prepared for Gemma 3 (896 × 896), Gemma 4 and Qwen 3.5: the
//! CPU cost an image adds to a request before the tower runs.
use criterion::{criterion_group, criterion_main, Criterion};
use image::codecs::jpeg::JpegEncoder;
use wick_media::{decode_image, ImageLimits, ImageProcessor};

/// A smooth 1000 × 1000 picture with texture, JPEG quality 90.
fn megapixel_jpeg() -> Vec<u8> {
    let (w, h) = (1000u32, 1000u32);
    let mut rgb = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let t = ((x * 7 + y * 13) % 64) as u8;
            rgb.extend_from_slice(&[(x / 4) as u8 ^ t, (y / 4) as u8, ((x + y) / 8) as u8 ^ t]);
        }
    }
    let mut out = Vec::new();
    JpegEncoder::new_with_quality(&mut out, 90)
        .encode(&rgb, w, h, image::ExtendedColorType::Rgb8)
        .expect("encode");
    out
}

fn bench(c: &mut Criterion) {
    let jpeg = megapixel_jpeg();
    let limits = ImageLimits::default();
    let gemma3 = ImageProcessor::Gemma3 { size: 896 };
    c.bench_function("decode+gemma3_896 1MP jpeg", |b| {
        b.iter(|| {
            let image = decode_image(&jpeg, &limits).expect("decode");
            gemma3.process(&image).expect("process")
        })
    });
    let image = decode_image(&jpeg, &limits).expect("decode");
    c.bench_function("gemma3_896 resize+normalize only", |b| {
        b.iter(|| gemma3.process(&image).expect("process"))
    });
    let gemma4 = ImageProcessor::Gemma4 {
        patch: 16,
        pool: 3,
        max_patches: 2520,
    };
    c.bench_function("gemma4_280 resize only", |b| {
        b.iter(|| gemma4.process(&image).expect("process"))
    });
    // Qwen 3.5's processor defaults: 1000 × 1000 rounds to 992 × 992 (no budget scaling).
    let qwen = ImageProcessor::Qwen {
        patch: 16,
        merge: 2,
        min_pixels: 65_536,
        max_pixels: 16_777_216,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    c.bench_function("decode+qwen35 1MP jpeg", |b| {
        b.iter(|| {
            let image = decode_image(&jpeg, &limits).expect("decode");
            qwen.process(&image).expect("process")
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
