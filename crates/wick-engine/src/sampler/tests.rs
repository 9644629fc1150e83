//! The sampler as a caller sees it: distributions, determinism, log-probabilities, and
//! rows that would make a careless sampler panic.
//!
//! Distribution tests draw 20,000 tokens at a fixed seed and compare the counts with the
//! expected probabilities by a chi-square statistic. The bound (60 for at most 9 degrees of
//! freedom, a p-value below 1e-8 for a correct sampler) cannot flake at a fixed seed, yet a
//! wrong temperature, a wrong kept set or a wrong mixture gives statistics in the hundreds.
use super::*;

const DRAWS: usize = 20_000;
const CHI_SQUARE_BOUND: f64 = 60.0;
const PROBS: [f64; 5] = [0.5, 0.25, 0.15, 0.07, 0.03];

fn ln_row(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(params, SamplerTokens::default()).expect("valid params")
}

/// Counts of each id over `DRAWS` steps from the same row.
fn counts(sampler: &mut Sampler, row: &[f32], history: &[u32]) -> Vec<usize> {
    let mut counts = vec![0; row.len()];
    for _ in 0..DRAWS {
        let mut logits = row.to_vec();
        counts[sampler.sample(&mut logits, history).id as usize] += 1;
    }
    counts
}

/// Normalizes non-negative weights.
fn normalized(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Asserts the counts fit `expected`: never a draw where the probability is 0, and a
/// chi-square statistic under the bound.
fn assert_fits(counts: &[usize], expected: &[f64], what: &str) {
    let n: usize = counts.iter().sum();
    let mut chi = 0.0;
    for (id, (&seen, &p)) in counts.iter().zip(expected).enumerate() {
        if p == 0.0 {
            assert_eq!(
                seen, 0,
                "{what}: token {id} drawn but excluded; counts {counts:?}"
            );
        } else {
            let want = p * n as f64;
            chi += (seen as f64 - want).powi(2) / want;
        }
    }
    assert!(
        chi < CHI_SQUARE_BOUND,
        "{what}: chi-square {chi:.1}; counts {counts:?}, expected {expected:?}"
    );
}

fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: 1234,
        ..SamplingParams::default()
    }
}

#[test]
fn temperature_one_follows_the_distribution() {
    let mut s = sampler(params(1.0));
    assert_fits(&counts(&mut s, &ln_row(&PROBS), &[]), &PROBS, "T=1");
}

#[test]
fn temperature_sharpens_and_flattens() {
    for temperature in [0.5f32, 2.0] {
        let expected = normalized(
            &PROBS
                .iter()
                .map(|p| p.powf(1.0 / f64::from(temperature)))
                .collect::<Vec<_>>(),
        );
        let mut s = sampler(params(temperature));
        assert_fits(
            &counts(&mut s, &ln_row(&PROBS), &[]),
            &expected,
            &format!("T={temperature}"),
        );
    }
}

#[test]
fn a_wrong_distribution_is_caught() {
    // The statistic must be able to fail: T=1 draws do not fit the T=2 distribution.
    let mut s = sampler(params(1.0));
    let seen = counts(&mut s, &ln_row(&PROBS), &[]);
    let flat = normalized(&PROBS.iter().map(|p| p.sqrt()).collect::<Vec<_>>());
    let chi: f64 = seen
        .iter()
        .zip(&flat)
        .map(|(&c, &p)| (c as f64 - p * DRAWS as f64).powi(2) / (p * DRAWS as f64))
        .sum();
    assert!(chi > 10.0 * CHI_SQUARE_BOUND, "chi-square {chi}");
}

#[test]
fn truncations_keep_the_right_sets() {
    let row = ln_row(&PROBS);
    let cases: Vec<(SamplingParams, Vec<f64>, &str)> = vec![
        (
            SamplingParams {
                top_p: 0.8,
                ..params(1.0)
            },
            vec![0.5, 0.25, 0.15, 0.0, 0.0],
            "top_p 0.8",
        ),
        (
            SamplingParams {
                top_p: 0.3,
                ..params(1.0)
            },
            vec![1.0, 0.0, 0.0, 0.0, 0.0],
            "top_p 0.3",
        ),
        (
            SamplingParams {
                min_p: 0.25,
                ..params(1.0)
            },
            vec![0.5, 0.25, 0.15, 0.0, 0.0],
            "min_p 0.25",
        ),
        (
            SamplingParams {
                min_p: 0.45,
                ..params(1.0)
            },
            vec![0.5, 0.25, 0.0, 0.0, 0.0],
            "min_p 0.45",
        ),
        (
            SamplingParams {
                top_k: 2,
                ..params(1.0)
            },
            vec![0.5, 0.25, 0.0, 0.0, 0.0],
            "top_k 2",
        ),
        (
            SamplingParams {
                top_k: 3,
                top_p: 0.6,
                ..params(1.0)
            },
            vec![0.5, 0.25, 0.0, 0.0, 0.0],
            "top_p 0.6 then top_k 3",
        ),
        (
            // top-p works on the untempered distribution, temperature only on the draw.
            SamplingParams {
                top_p: 0.8,
                ..params(2.0)
            },
            vec![0.5f64.sqrt(), 0.25f64.sqrt(), 0.15f64.sqrt(), 0.0, 0.0],
            "top_p 0.8 at T=2",
        ),
    ];
    for (params, weights, what) in cases {
        let mut s = sampler(params);
        assert_fits(&counts(&mut s, &row, &[]), &normalized(&weights), what);
    }
}

#[test]
fn xtc_removes_top_choices_with_its_probability() {
    let row = ln_row(&PROBS);
    let xtc = |probability, threshold| SamplingParams {
        xtc_probability: probability,
        xtc_threshold: threshold,
        ..params(1.0)
    };
    let after = normalized(&[0.0, 0.0, 0.15, 0.07, 0.03]);
    let mut s = sampler(xtc(1.0, 0.1));
    assert_fits(&counts(&mut s, &row, &[]), &after, "xtc always");

    let half: Vec<f64> = PROBS
        .iter()
        .zip(&after)
        .map(|(p, a)| 0.5 * p + 0.5 * a)
        .collect();
    let mut s = sampler(xtc(0.5, 0.1));
    assert_fits(&counts(&mut s, &row, &[]), &half, "xtc half the time");

    // EOS and newline tokens are never removed.
    let special = SamplerTokens {
        eos_ids: vec![0],
        newline_id: Some(1),
    };
    let mut s = Sampler::new(xtc(1.0, 0.1), special).expect("valid params");
    assert_fits(&counts(&mut s, &row, &[]), &PROBS, "xtc with exempt tokens");

    // top-k comes after XTC: of {2, 3, 4}, keep 2 — on the whole row and after top-p.
    let expected = normalized(&[0.0, 0.0, 0.15, 0.07, 0.0]);
    for top_p in [1.0, 0.999] {
        let mut s = sampler(SamplingParams {
            top_k: 2,
            top_p,
            ..xtc(1.0, 0.1)
        });
        assert_fits(&counts(&mut s, &row, &[]), &expected, "xtc then top_k");
    }
}

#[test]
fn penalties_change_the_distribution() {
    // A frequency penalty of ln 2 on one occurrence halves token 0's weight.
    let mut s = sampler(SamplingParams {
        frequency_penalty: std::f32::consts::LN_2,
        ..params(1.0)
    });
    let expected = normalized(&[0.25, 0.25, 0.15, 0.07, 0.03]);
    assert_fits(
        &counts(&mut s, &ln_row(&PROBS), &[0]),
        &expected,
        "frequency",
    );
}

#[test]
fn processors_run_in_mlx_order() {
    // bias first (+1 → 2), then repetition (/2 → 1), presence (−0.25), frequency (−0.5 × 2).
    let mut s = sampler(SamplingParams {
        logit_bias: vec![(0, 1.0)],
        repetition_penalty: 2.0,
        presence_penalty: 0.25,
        frequency_penalty: 0.5,
        ..params(0.0)
    });
    let mut logits = vec![1.0, 0.0, -1.0];
    s.sample(&mut logits, &[0, 0, 2]);
    let want = [2.0 / 2.0 - 0.25 - 1.0, 0.0, -2.0 - 0.25 - 0.5];
    for (got, want) in logits.iter().zip(want) {
        assert!((got - want).abs() < 1e-6, "{logits:?}");
    }
}

/// A deterministic pseudo-random row shaped like model output (a few strong tokens and a
/// long tail).
fn model_like_row(vocab: usize, salt: u64) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..vocab)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            let v = ((state >> 16) & 0xffff) as f32 / 65536.0;
            4.0 * u - 12.0 * v * v + if state & 0x3f == 0 { 6.0 } else { 0.0 }
        })
        .collect()
}

#[test]
fn same_seed_same_tokens_whatever_runs_alongside() {
    let row = model_like_row(5000, 1);
    let p = |seed| SamplingParams {
        top_p: 0.9,
        min_p: 0.01,
        xtc_probability: 0.3,
        xtc_threshold: 0.05,
        seed,
        ..params(1.0)
    };
    let run = |sampler: &mut Sampler| -> Vec<u32> {
        (0..200)
            .map(|_| sampler.sample(&mut row.clone(), &[]).id)
            .collect()
    };
    let alone_a = run(&mut sampler(p(11)));
    let alone_b = run(&mut sampler(p(12)));
    assert_eq!(alone_a, run(&mut sampler(p(11))));
    assert_ne!(alone_a, alone_b);
    // Interleaved, as in a batch: each request still gets its own sequence.
    let (mut a, mut b) = (sampler(p(11)), sampler(p(12)));
    let mut mixed_a = Vec::new();
    let mut mixed_b = Vec::new();
    for _ in 0..200 {
        mixed_b.push(b.sample(&mut row.clone(), &[]).id);
        mixed_a.push(a.sample(&mut row.clone(), &[]).id);
    }
    assert_eq!((mixed_a, mixed_b), (alone_a.clone(), alone_b));
    // Replaying from a step gives the same tokens.
    let mut c = sampler(p(11));
    c.set_step(150);
    let replay: Vec<u32> = (0..50)
        .map(|_| c.sample(&mut row.clone(), &[]).id)
        .collect();
    assert_eq!(replay, alone_a[150..]);
}

#[test]
fn top_k_one_is_greedy() {
    let mut greedy = sampler(params(0.0));
    for salt in 0..50 {
        let mut row = model_like_row(3000, salt);
        if salt % 5 == 0 {
            // A tie for the top: the lower id wins both ways.
            let top = row.iter().cloned().fold(f32::MIN, f32::max);
            row[2999] = top;
            row[17] = top;
        }
        let want = greedy.sample(&mut row.clone(), &[]).id;
        for temperature in [0.3, 1.0, 5.0] {
            let mut s = sampler(SamplingParams {
                top_k: 1,
                seed: salt,
                ..params(temperature)
            });
            assert_eq!(s.sample(&mut row.clone(), &[]).id, want, "salt {salt}");
        }
    }
}

/// Log-softmax in f64 for reference.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

#[test]
fn top_p_on_a_large_row_draws_only_from_the_nucleus() {
    let row = model_like_row(20_000, 5);
    let lp = log_softmax(&row);
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    let mut mass = 0.0;
    let mut nucleus = std::collections::HashSet::new();
    for &id in &order {
        if mass >= 0.6 {
            break;
        }
        nucleus.insert(id);
        mass += lp[id].exp();
    }
    assert!(nucleus.len() > 10, "test row too peaked: {}", nucleus.len());
    let mut s = sampler(SamplingParams {
        top_p: 0.6,
        ..params(1.0)
    });
    let mut seen = std::collections::HashSet::new();
    for _ in 0..5000 {
        let id = s.sample(&mut row.clone(), &[]).id as usize;
        assert!(nucleus.contains(&id), "token {id} outside the nucleus");
        seen.insert(id);
    }
    assert!(seen.len() > nucleus.len() / 2);
}

#[test]
fn logprobs_are_the_full_processed_distribution() {
    let row = ln_row(&PROBS);
    let mut s = sampler(SamplingParams {
        logprobs: Some(5),
        top_k: 1,
        logit_bias: vec![(4, 2.0)],
        ..params(1.0)
    });
    let mut logits = row.clone();
    let out = s.sample(&mut logits, &[]);
    let mut biased = row.clone();
    biased[4] += 2.0;
    let want = log_softmax(&biased);
    // Sorted, most likely first, and a distribution.
    assert_eq!(out.top_logprobs.len(), 5);
    assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
    let total: f64 = out
        .top_logprobs
        .iter()
        .map(|(_, lp)| f64::from(*lp).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-5, "sum {total}");
    for &(id, lp) in &out.top_logprobs {
        assert!((f64::from(lp) - want[id as usize]).abs() < 1e-5);
    }
    // top_k = 1 keeps only token 0, but its log-probability is taken before truncation.
    assert_eq!(out.id, 0);
    assert!((f64::from(out.logprob) - want[0]).abs() < 1e-5);
}

#[test]
fn logprobs_on_a_large_row_and_when_not_asked() {
    let row = model_like_row(151_936, 3);
    let want = log_softmax(&row);
    let mut s = sampler(SamplingParams {
        logprobs: Some(20),
        ..params(0.0)
    });
    let out = s.sample(&mut row.clone(), &[]);
    assert_eq!(out.top_logprobs.len(), 20);
    assert_eq!(out.top_logprobs[0].0, out.id);
    assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
    for &(id, lp) in &out.top_logprobs {
        assert!((f64::from(lp) - want[id as usize]).abs() < 1e-4, "{id}");
    }
    let mut s = sampler(SamplingParams {
        logprobs: Some(0),
        ..params(0.7)
    });
    let out = s.sample(&mut row.clone(), &[]);
    assert!(out.top_logprobs.is_empty());
    assert!((f64::from(out.logprob) - want[out.id as usize]).abs() < 1e-4);
    let mut s = sampler(params(0.0));
    let out = s.sample(&mut row.clone(), &[]);
    assert!(out.logprob.is_nan() && out.top_logprobs.is_empty());
}

#[test]
fn hostile_rows_do_not_panic() {
    let all = SamplingParams {
        top_p: 0.9,
        top_k: 3,
        min_p: 0.1,
        xtc_probability: 1.0,
        xtc_threshold: 0.1,
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.5,
        logit_bias: vec![(1_000_000, 5.0), (0, -1.0)],
        logprobs: Some(3),
        ..params(0.8)
    };
    let rows: Vec<Vec<f32>> = vec![
        vec![],
        vec![f32::NEG_INFINITY; 7],
        vec![f32::NAN; 7],
        vec![0.0, f32::NAN, 1.0, f32::NEG_INFINITY],
        vec![f32::MAX, f32::MAX, -f32::MAX],
        vec![3.0],
    ];
    for p in [
        all.clone(),
        params(0.0),
        params(1.0),
        SamplingParams {
            temperature: 0.0,
            ..all
        },
    ] {
        let mut s = sampler(p);
        for row in &rows {
            let out = s.sample(&mut row.clone(), &[5, 999_999, 0, 0]);
            assert!(row.is_empty() || (out.id as usize) < row.len(), "{row:?}");
        }
    }
    // Where a finite logit exists, it is the one drawn.
    let mut s = sampler(params(1.0));
    let row = [f32::NAN, f32::NEG_INFINITY, 2.0, f32::NAN];
    assert_eq!(s.sample(&mut row.to_vec(), &[]).id, 2);
}

#[test]
fn invalid_params_are_refused() {
    let err = Sampler::new(
        SamplingParams {
            top_p: 0.0,
            ..params(1.0)
        },
        SamplerTokens::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
}

#[test]
fn full_row_draws_span_blocks() {
    // Equal weight on one token in each of 10 blocks of a 10,240-entry row, plus a uniform
    // row binned into 10 ranges: both cover the blocked weight walk of the whole-row path.
    let mut row = vec![f32::NEG_INFINITY; 10_240];
    for block in 0..10 {
        row[block * 1024 + 5] = 0.0;
    }
    let mut s = sampler(params(1.0));
    let mut bins = vec![0usize; 10];
    for _ in 0..DRAWS {
        let id = s.sample(&mut row.clone(), &[]).id as usize;
        assert_eq!(id % 1024, 5);
        bins[id / 1024] += 1;
    }
    assert_fits(&bins, &[0.1; 10], "one token per block");
    let row = vec![0.25f32; 10_000];
    let mut bins = vec![0usize; 10];
    for _ in 0..DRAWS {
        bins[s.sample(&mut row.clone(), &[]).id as usize / 1000] += 1;
    }
    assert_fits(&bins, &[0.1; 10], "uniform row");
}
