//! Training tokens per second of SFT steps on random tokens (the comparison with
//! PyTorch + PEFT in docs/lab/training.md, "LoRA training"):
//! `cargo run --release -p wick-train --example train_speed -- MODEL BATCH SEQ STEPS THREADS`.
//! Every position is a target, as a `text` dataset trains; one warm-up step is not timed.
use std::time::Instant;

use rand::{Rng, SeedableRng};
use wick_train::base::BaseWeights;
use wick_train::data::{Example, Sequence};
use wick_train::loss::Method;
use wick_train::trainer::{TrainConfig, Trainer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, batch, seq, steps, threads] = args.as_slice() else {
        return Err("usage: train_speed MODEL BATCH SEQ STEPS THREADS".into());
    };
    let (batch, seq, steps): (usize, usize, usize) = (batch.parse()?, seq.parse()?, steps.parse()?);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.parse()?)
        .build_global()?;
    let base = BaseWeights::load(model.as_ref())?;
    let mut cfg = TrainConfig::defaults(Method::Sft);
    cfg.batch = batch;
    cfg.max_seq = seq;
    cfg.iters = steps + 1;
    let mut trainer = Trainer::new(&base, cfg)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let vocab = base.cfg.vocab_size as u32;
    let examples: Vec<Example> = (0..batch)
        .map(|_| {
            Example::Sft(Sequence {
                tokens: (0..seq).map(|_| rng.random_range(0..vocab)).collect(),
                prompt_len: 0,
            })
        })
        .collect();
    let micro = vec![examples.iter().collect::<Vec<_>>()];
    trainer.train_step(&micro)?;
    let t = Instant::now();
    for _ in 0..steps {
        trainer.train_step(&micro)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "wick tokens/s {:.1} ({} steps of {}x{} in {:.2}s)",
        (steps * batch * seq) as f64 / secs,
        steps,
        batch,
        seq,
        secs
    );
    Ok(())
}
