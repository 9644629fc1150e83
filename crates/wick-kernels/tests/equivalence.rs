//! Every fast path against a slow one: our ggml decoding against candle's dequantize,
//! the packed layout against the file layout, and every kernel family against the f64
//! reference product (and against each other, bit for bit).
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::Device;
use wick_kernels::{
    ggml, matmul, reference, Isa, PackedMatrix, Product, QuantizedActivations, ThreadPool,
    WeightFormat,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal_ish(&mut self) -> f32 {
        (self.f32() + self.f32() + self.f32() - 1.5) * 2.0
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random but valid file bytes: random codes, finite scales of realistic size.
fn random_matrix(format: WeightFormat, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = format.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
    let bb = format.block_bytes();
    for block in bytes.chunks_exact_mut(bb) {
        let mut scale =
            || f16_bytes((rng.f32() * 0.05 + 0.001) * if rng.next() & 1 == 0 { 1.0 } else { -1.0 });
        match format {
            WeightFormat::F32 => block.copy_from_slice(&rng.normal_ish().to_le_bytes()),
            WeightFormat::F16 => block.copy_from_slice(&f16_bytes(rng.normal_ish())),
            WeightFormat::Bf16 => {
                block.copy_from_slice(&((rng.normal_ish().to_bits() >> 16) as u16).to_le_bytes())
            }
            WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => {
                block[0..2].copy_from_slice(&scale())
            }
            WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4K | WeightFormat::Q5K => {
                block[0..2].copy_from_slice(&scale());
                block[2..4].copy_from_slice(&scale());
            }
            WeightFormat::Q6K => block[208..210].copy_from_slice(&scale()),
        }
    }
    bytes
}

fn candle_dtype(f: WeightFormat) -> GgmlDType {
    match f {
        WeightFormat::F32 => GgmlDType::F32,
        WeightFormat::F16 => GgmlDType::F16,
        WeightFormat::Bf16 => GgmlDType::BF16,
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
        WeightFormat::Q4_1 => GgmlDType::Q4_1,
        WeightFormat::Q5_0 => GgmlDType::Q5_0,
        WeightFormat::Q5_1 => GgmlDType::Q5_1,
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        WeightFormat::Q4K => GgmlDType::Q4K,
        WeightFormat::Q5K => GgmlDType::Q5K,
        WeightFormat::Q6K => GgmlDType::Q6K,
    }
}

fn cols_for(f: WeightFormat) -> usize {
    if f.block_elems() == 256 {
        512
    } else {
        96
    }
}

#[test]
fn ggml_decoding_matches_candle_dequantize() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for format in WeightFormat::ALL {
        let (rows, cols) = (5, cols_for(format));
        let bytes = random_matrix(format, rows, cols, &mut rng);
        let q = qtensor_from_ggml(candle_dtype(format), &bytes, vec![rows, cols], &Device::Cpu)
            .unwrap();
        let theirs: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let row_bytes = format.row_bytes(cols).unwrap();
        for r in 0..rows {
            let mut ours = vec![0f32; cols];
            ggml::dequantize_row(
                format,
                &bytes[r * row_bytes..(r + 1) * row_bytes],
                &mut ours,
            )
            .unwrap();
            for c in 0..cols {
                assert_eq!(ours[c], theirs[r * cols + c], "{format:?} row {r} col {c}");
            }
        }
    }
}

#[test]
fn packed_rows_dequantize_exactly_like_the_file() {
    let mut rng = Rng(77);
    for format in WeightFormat::ALL {
        // 37 rows: two full strips and a padded one.
        let (rows, cols) = (37, cols_for(format));
        let bytes = random_matrix(format, rows, cols, &mut rng);
        let packed = PackedMatrix::from_ggml(format, rows, cols, &bytes).unwrap();
        let row_bytes = format.row_bytes(cols).unwrap();
        for r in 0..rows {
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            ggml::dequantize_row(format, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut a)
                .unwrap();
            packed.dequantize_row(r, &mut b).unwrap();
            assert_eq!(a, b, "{format:?} row {r}");
        }
        assert!(packed.dequantize_row(rows, &mut vec![0f32; cols]).is_err());
    }
}

fn check_close(format: WeightFormat, got: &[f32], want: &[f64], bound: &[f64], what: &str) {
    for i in 0..got.len() {
        let err = (got[i] as f64 - want[i]).abs();
        assert!(
            err <= 2e-6 * bound[i] + 1e-6,
            "{what} {format:?} [{i}]: {} vs {} (bound {})",
            got[i],
            want[i],
            bound[i]
        );
    }
}

/// Σ|w·x| per output, the natural scale of f32 rounding error.
fn magnitudes(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    x: &[f32],
    n: usize,
) -> Vec<f64> {
    let abs_bytes: Vec<u8> = bytes.to_vec();
    let row_bytes = format.row_bytes(cols).unwrap();
    let mut out = vec![0f64; n * rows];
    let mut w = vec![0f32; cols];
    for r in 0..rows {
        ggml::dequantize_row(
            format,
            &abs_bytes[r * row_bytes..(r + 1) * row_bytes],
            &mut w,
        )
        .unwrap();
        for t in 0..n {
            out[t * rows + r] = (0..cols)
                .map(|c| (w[c] as f64 * x[t * cols + c] as f64).abs())
                .sum();
        }
    }
    out
}

#[test]
fn every_kernel_family_matches_the_reference_and_each_other() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(4242);
    // 37 rows: two full strips and a padded one; 205 rows: the 8- and 4-strip decode
    // tiles, a single strip and a padded one.
    for (format, rows) in WeightFormat::ALL
        .into_iter()
        .flat_map(|f| [(f, 37), (f, 205)])
    {
        let cols = cols_for(format);
        let bytes = random_matrix(format, rows, cols, &mut rng);
        let packed = PackedMatrix::from_ggml(format, rows, cols, &bytes).unwrap();
        let bias: Vec<f32> = (0..rows).map(|_| rng.normal_ish()).collect();
        for n in [1, 2, 3, 5, 8, 9, 17, 70] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal_ish()).collect();
            let mut act = QuantizedActivations::new();
            act.quantize(Isa::Scalar, &x, n, cols).unwrap();
            let want = reference::matmul(format, rows, cols, &bytes, &x, n, Some(&act)).unwrap();
            let bound = magnitudes(format, rows, cols, &bytes, &x, n);
            let mut first: Option<Vec<f32>> = None;
            for isa in Isa::available() {
                for with_bias in [false, true] {
                    let mut out = vec![f32::NAN; n * rows];
                    let mut scratch = QuantizedActivations::new();
                    matmul(
                        &pool,
                        isa,
                        &x,
                        n,
                        &mut [Product {
                            weight: &packed,
                            out: &mut out,
                            bias: with_bias.then_some(&bias[..]),
                        }],
                        &mut scratch,
                    )
                    .unwrap();
                    let want: Vec<f64> = (0..n * rows)
                        .map(|i| {
                            want[i]
                                + if with_bias {
                                    bias[i % rows] as f64
                                } else {
                                    0.0
                                }
                        })
                        .collect();
                    check_close(
                        format,
                        &out,
                        &want,
                        &bound,
                        &format!("{isa:?} n={n} bias={with_bias}"),
                    );
                    if !with_bias {
                        match &first {
                            None => first = Some(out),
                            Some(f) => assert!(
                                f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{format:?} n={n}: {isa:?} differs from the scalar family"
                            ),
                        }
                    }
                }
            }
        }
    }
}

/// Batched decode must not change a sequence's numbers: every row of a many-token call
/// equals, bit for bit, a one-token call on that row alone (the engine's "batched output
/// equals running alone" rests on this), for every family and every tile width.
#[test]
fn each_row_of_a_batch_equals_its_own_call() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(777);
    for format in WeightFormat::ALL {
        // 133 rows: a padded last strip after an odd number of full ones.
        let (rows, cols) = (133, cols_for(format) * 2);
        let bytes = random_matrix(format, rows, cols, &mut rng);
        let packed = PackedMatrix::from_ggml(format, rows, cols, &bytes).unwrap();
        let bias: Vec<f32> = (0..rows).map(|_| rng.normal_ish()).collect();
        let n = 19;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal_ish()).collect();
        for isa in Isa::available() {
            let mut act = QuantizedActivations::new();
            let mut run = |x: &[f32], n: usize| {
                let mut out = vec![f32::NAN; n * rows];
                matmul(
                    &pool,
                    isa,
                    x,
                    n,
                    &mut [Product {
                        weight: &packed,
                        out: &mut out,
                        bias: Some(&bias),
                    }],
                    &mut act,
                )
                .unwrap();
                out
            };
            let alone: Vec<Vec<f32>> = (0..n)
                .map(|t| run(&x[t * cols..(t + 1) * cols], 1))
                .collect();
            for m in (2..=n).filter(|m| *m <= 9 || *m == 16 || *m == n) {
                let batch = run(&x[..m * cols], m);
                for (t, want) in alone.iter().take(m).enumerate() {
                    let got = &batch[t * rows..(t + 1) * rows];
                    assert!(
                        got.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{format:?} {isa:?}: row {t} of {m} differs from its own call"
                    );
                }
            }
        }
    }
}

/// The AMX kernels (whole tiles of 16 tokens on the tile unit, leftovers on AVX-512)
/// against the scalar kernels, bit for bit, for every quantized format: token counts with
/// and without leftovers, several 64-token chunks, a padded last strip, activations that
/// saturate to ±127. Where AMX is absent (or Linux refuses its state) the test says so
/// and checks nothing.
#[test]
fn amx_tiles_equal_the_scalar_kernels_bit_for_bit() {
    if let Err(why) = wick_kernels::amx::support() {
        eprintln!("AMX test skipped: {why}");
        return;
    }
    assert!(Isa::available().contains(&Isa::Amx));
    let pool = ThreadPool::new(2);
    let mut rng = Rng(0xA3A3);
    for format in WeightFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
        let (rows, cols) = (37, 2 * cols_for(format));
        let bytes = random_matrix(format, rows, cols, &mut rng);
        let packed = PackedMatrix::from_ggml(format, rows, cols, &bytes).unwrap();
        let bias: Vec<f32> = (0..rows).map(|_| rng.normal_ish()).collect();
        for n in [16, 33, 64, 100, 130] {
            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.normal_ish()).collect();
            // Every third block of every other token all ±1: codes of ±127 throughout.
            for (t, row) in x
                .chunks_exact_mut(cols)
                .enumerate()
                .filter(|(t, _)| t % 2 == 0)
            {
                for (b, block) in row
                    .chunks_exact_mut(32)
                    .enumerate()
                    .filter(|(b, _)| b % 3 == t % 3)
                {
                    let sign = if (t + b) % 2 == 0 { 1.0 } else { -1.0 };
                    block.iter_mut().for_each(|v| *v = sign);
                }
            }
            let run = |isa: Isa| {
                let mut out = vec![f32::NAN; n * rows];
                let mut act = QuantizedActivations::new();
                matmul(
                    &pool,
                    isa,
                    &x,
                    n,
                    &mut [Product {
                        weight: &packed,
                        out: &mut out,
                        bias: Some(&bias),
                    }],
                    &mut act,
                )
                .unwrap();
                out
            };
            let (want, got) = (run(Isa::Scalar), run(Isa::Amx));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "{format:?} n={n} token {} row {}: AMX {a} vs scalar {b}",
                    i / rows,
                    i % rows
                );
            }
        }
    }
}

/// One [`QuantizedActivations`] reused across calls of different widths and row counts
/// (as a layer alternates 896- and 4,864-column inputs; its buffers only grow) gives
/// each call the bits of fresh buffers, on every kernel family — on AMX machines also
/// after a wider call left more tile scales than the next one lays out.
#[test]
fn reused_activation_buffers_give_the_bits_of_fresh_ones() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(0x5EED);
    let formats = [WeightFormat::Q8_0, WeightFormat::Q4K];
    let shapes = [(512, 100), (256, 48), (512, 20), (256, 130), (512, 33)];
    let matrices: Vec<_> = shapes
        .iter()
        .flat_map(|&(cols, _)| formats.map(|f| (f, cols)))
        .map(|(f, cols)| {
            let bytes = random_matrix(f, 24, cols, &mut rng);
            (
                (f, cols),
                PackedMatrix::from_ggml(f, 24, cols, &bytes).unwrap(),
            )
        })
        .collect();
    for isa in Isa::available() {
        let mut reused = QuantizedActivations::new();
        for &(cols, n) in &shapes {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal_ish()).collect();
            for ((_, c), w) in matrices.iter().filter(|((_, c), _)| *c == cols) {
                let run = |act: &mut QuantizedActivations| {
                    let mut out = vec![f32::NAN; n * w.rows()];
                    let products = &mut [Product {
                        weight: w,
                        out: &mut out,
                        bias: None,
                    }];
                    matmul(&pool, isa, &x, n, products, act).unwrap();
                    out
                };
                let want = run(&mut QuantizedActivations::new());
                let got = run(&mut reused);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} {:?} {c} columns, {n} rows: reused buffers differ",
                    w.format()
                );
            }
        }
    }
}

#[test]
fn several_matrices_share_one_call() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(99);
    let cols = 256;
    let formats = [
        WeightFormat::Q5_0,
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::F16,
    ];
    let rows = [64, 16, 48, 8];
    let mats: Vec<(Vec<u8>, PackedMatrix)> = formats
        .iter()
        .zip(rows)
        .map(|(&f, r)| {
            let b = random_matrix(f, r, cols, &mut rng);
            let p = PackedMatrix::from_ggml(f, r, cols, &b).unwrap();
            (b, p)
        })
        .collect();
    for n in [1, 7, 40] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal_ish()).collect();
        let mut outs: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0f32; n * r]).collect();
        let mut act = QuantizedActivations::new();
        {
            let mut products: Vec<Product<'_>> = mats
                .iter()
                .zip(outs.iter_mut())
                .map(|((_, p), o)| Product {
                    weight: p,
                    out: o,
                    bias: None,
                })
                .collect();
            matmul(&pool, Isa::best(), &x, n, &mut products, &mut act).unwrap();
        }
        for (i, ((bytes, _), out)) in mats.iter().zip(&outs).enumerate() {
            let want =
                reference::matmul(formats[i], rows[i], cols, bytes, &x, n, Some(&act)).unwrap();
            let bound = magnitudes(formats[i], rows[i], cols, bytes, &x, n);
            check_close(formats[i], out, &want, &bound, "shared call");
        }
    }
}

#[test]
fn mismatched_shapes_are_errors() {
    let pool = ThreadPool::new(1);
    let mut rng = Rng(5);
    let a = PackedMatrix::from_ggml(
        WeightFormat::Q8_0,
        16,
        64,
        &random_matrix(WeightFormat::Q8_0, 16, 64, &mut rng),
    )
    .unwrap();
    let b = PackedMatrix::from_ggml(
        WeightFormat::Q8_0,
        16,
        96,
        &random_matrix(WeightFormat::Q8_0, 16, 96, &mut rng),
    )
    .unwrap();
    let mut act = QuantizedActivations::new();
    let (mut o1, mut o2) = (vec![0f32; 16], vec![0f32; 16]);
    let x = vec![0f32; 64];
    let r = matmul(
        &pool,
        Isa::best(),
        &x,
        1,
        &mut [
            Product {
                weight: &a,
                out: &mut o1,
                bias: None,
            },
            Product {
                weight: &b,
                out: &mut o2,
                bias: None,
            },
        ],
        &mut act,
    );
    assert!(r.is_err());
    let r = matmul(
        &pool,
        Isa::best(),
        &x[..32],
        1,
        &mut [Product {
            weight: &a,
            out: &mut o1,
            bias: None,
        }],
        &mut act,
    );
    assert!(r.is_err());
    assert!(PackedMatrix::from_ggml(WeightFormat::Q4K, 1, 96, &[0u8; 54]).is_err());
    assert!(PackedMatrix::from_ggml(WeightFormat::Q8_0, 2, 32, &[0u8; 34]).is_err());
}
