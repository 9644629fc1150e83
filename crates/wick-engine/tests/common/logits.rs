//! Forward passes as the reference tests run them (through a backend's `Decoder`, or the
//! engine's `Model`), the greedy pick, and how far two sets of logits are apart.
use wick_engine::backend::Backend;
use wick_engine::models::decoder::{BatchItem, Decoder, Input, RowOutput, SequenceCache};
use wick_engine::{KvCache, Logits, LogitsRequest, Model, Step, Want};

/// Largest difference from the reference logits the text goldens allow, relative to the
/// largest |logit| of the reference (at least 1).
pub const TOLERANCE: f32 = 1e-4;

/// One pass of `tokens` on `cache`: the logits `request` asks for.
pub fn pass<B: Backend>(
    m: &Decoder<B>,
    tokens: &[u32],
    cache: &mut SequenceCache<B>,
    request: LogitsRequest,
) -> Option<Logits> {
    m.forward_logits(&mut [BatchItem::new(tokens, cache, Want::logits(request))])
        .unwrap()
        .remove(0)
}

/// One pass of `tokens` on `cache` through the engine's model: the logits `request` asks
/// for.
pub fn model_pass(
    model: &Model,
    tokens: &[u32],
    cache: &mut KvCache,
    request: LogitsRequest,
) -> Option<Logits> {
    model
        .forward(&mut [Step {
            tokens,
            cache,
            logits: request,
        }])
        .unwrap()
        .remove(0)
}

/// Logits of every position of `ids`, fed in pieces of `chunks` (cycled) through one cache.
pub fn forward_all<B: Backend>(m: &Decoder<B>, ids: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut cache = m.new_cache();
    let mut got = Vec::new();
    let mut at = 0;
    for &c in chunks.iter().cycle() {
        if at >= ids.len() {
            break;
        }
        let end = (at + c).min(ids.len());
        let out = pass(m, &ids[at..end], &mut cache, LogitsRequest::All);
        got.extend_from_slice(&out.unwrap().data);
        at = end;
    }
    got
}

/// One pass over several sequences batched (tokens, cache, which logits): each
/// sequence's logits.
pub fn forward_batch<B: Backend>(
    m: &Decoder<B>,
    seqs: Vec<(&[u32], &mut SequenceCache<B>, LogitsRequest)>,
) -> Vec<Vec<f32>> {
    let mut items: Vec<_> = seqs
        .into_iter()
        .map(|(tokens, cache, logits)| BatchItem::new(tokens, cache, Want::logits(logits)))
        .collect();
    m.forward_logits(&mut items)
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap().data)
        .collect()
}

/// `n` greedy tokens after `prompt`: the prompt in one pass, then one token a pass, each
/// the [`argmax`] of the last row.
pub fn greedy_decode<B: Backend>(m: &Decoder<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let mut next = prompt.to_vec();
    let mut got = Vec::new();
    while got.len() < n {
        let logits = pass(m, &next, &mut cache, LogitsRequest::Last).unwrap();
        let id = argmax(logits.last());
        got.push(id);
        next = vec![id];
    }
    got
}

/// The index of the largest value (the first of equal ones, as torch and llama.cpp pick).
pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(0, |b, (j, &v)| if v > row[b] { j } else { b }) as u32
}

/// The largest |got − want| and the scale it is judged against: the largest |want|, at
/// least 1.
pub fn worst(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (worst, scale)
}

/// Fails unless every value of `got` is within `tolerance` × the scale of `want` (see
/// [`worst`]).
pub fn assert_relative(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (worst, scale) = worst(got, want);
    assert!(
        worst <= tolerance * scale,
        "{what}: max |diff| {worst} > {tolerance} × {scale}"
    );
}

/// [`assert_relative`] at the text goldens' [`TOLERANCE`], for golden `variant`.
pub fn assert_near(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    assert_relative(&format!("{variant} {what}"), got, want, TOLERANCE);
}

/// `steps` greedy tokens after each of `prompts` in lockstep with the argmax kept on the
/// device (what `wick bench` and the scheduler's greedy batches run): each step is fed
/// the last step's ids without the host reading them first, so Gemma 4's per-layer inputs
/// embed ids the backend holds.
pub fn greedy_lockstep<B: Backend>(
    d: &Decoder<B>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Vec<u32>> {
    let mut caches: Vec<SequenceCache<B>> = prompts.iter().map(|_| d.new_cache()).collect();
    let mut items: Vec<BatchItem<'_, B>> = prompts
        .iter()
        .zip(caches.iter_mut())
        .map(|(p, c)| BatchItem::new(p, c, Want::Token))
        .collect();
    let first: Vec<u32> = d
        .execute(&mut items, None)
        .unwrap()
        .into_iter()
        .map(|o| match o {
            RowOutput::Token(id) => id,
            other => panic!("no token: {other:?}"),
        })
        .collect();
    drop(items);
    let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
    let mut refs: Vec<&mut SequenceCache<B>> = caches.iter_mut().collect();
    let be = d.backend();
    let mut current: Option<B::Ids> = None;
    for _ in 1..steps {
        let input = match &current {
            None => Input::Host(&first),
            Some(ids) => Input::Backend(ids),
        };
        let next = d.decode_ids(input, &mut refs).unwrap();
        if let Some(ids) = &current {
            for (o, id) in out.iter_mut().zip(be.ids_to_host(ids).unwrap()) {
                o.push(id);
            }
        }
        current = Some(next);
    }
    if let Some(ids) = &current {
        for (o, id) in out.iter_mut().zip(be.ids_to_host(ids).unwrap()) {
            o.push(id);
        }
    }
    out
}
