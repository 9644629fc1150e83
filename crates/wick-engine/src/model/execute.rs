//! [`Model::execute`]: the one entry point of a forward pass. The scheduler (or any caller)
//! plans a step — which sequences advance, by which tokens, what each wants back, with which
//! adapters — and the model runs it on whichever backend it was loaded onto.
use super::dispatch::{with_decoder, AnyDecoder, CacheOf};
use super::{KvCache, Model, Step};
use crate::adapters::{AdapterStack, LoraOf};
use crate::models::decoder::{
    BatchItem, Decoder, Logits, LogitsRequest, RowOutput, StepMasks, Want,
};
use crate::Result;

/// One sequence's part of a step.
pub struct StepRow<'a> {
    /// New tokens, appended after what the cache holds.
    pub tokens: &'a [u32],
    /// The sequence's cache; grows by `tokens.len()`.
    pub cache: &'a mut KvCache,
    /// What the sequence wants back.
    pub want: Want,
    /// The adapters it runs with (`None` or an empty stack: the base model).
    pub adapters: Option<&'a AdapterStack>,
}

/// A planned forward pass: the rows of the sequences it advances, and the token masks of
/// rows that pick their token under a grammar ([`Want::MaskedToken`]).
#[derive(Default)]
pub struct StepPlan<'a> {
    /// The rows, in the order outputs come back.
    pub rows: Vec<StepRow<'a>>,
    /// The masks of [`Want::MaskedToken`] rows, computed while the pass runs.
    pub masks: Option<StepMasks<'a>>,
}

impl<'a> StepPlan<'a> {
    /// A plan of `rows`.
    pub fn new(rows: Vec<StepRow<'a>>) -> Self {
        StepPlan { rows, masks: None }
    }

    /// Adds a row on the base model.
    pub fn row(mut self, tokens: &'a [u32], cache: &'a mut KvCache, want: Want) -> Self {
        self.rows.push(StepRow {
            tokens,
            cache,
            want,
            adapters: None,
        });
        self
    }

    /// Sets where masked rows' masks come from (see [`StepMasks`]).
    pub fn with_masks(mut self, masks: StepMasks<'a>) -> Self {
        self.masks = Some(masks);
        self
    }
}

impl Model {
    /// Runs one planned step: every row's new tokens through the model in one batched
    /// pass (each row with its adapters; the base products once for the whole batch,
    /// then each adapter's low-rank products over the rows that use it), appending to
    /// each cache, and returns what each row wants, in order. A row gets what it asked
    /// for, except that when the pass brings logits to the host for one row, rows asking
    /// for a token get their logits instead ([`RowOutput`]).
    pub fn execute(&self, plan: StepPlan<'_>) -> Result<Vec<RowOutput>> {
        with_decoder!(&self.decoder, d => execute_on(d, plan))
    }

    /// [`Model::execute`] of steps that each want logits of the positions they ask for:
    /// the simplest plan, for scoring and tests.
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Vec<Option<Logits>>> {
        let rows = steps
            .iter_mut()
            .map(|s| StepRow {
                tokens: s.tokens,
                cache: &mut *s.cache,
                want: Want::logits(s.logits),
                adapters: None,
            })
            .collect();
        Ok(self
            .execute(StepPlan::new(rows))?
            .into_iter()
            .map(|o| match o {
                RowOutput::Logits(l) => Some(l),
                _ => None,
            })
            .collect())
    }

    /// [`Model::execute`] of steps that each want the final-normed hidden states
    /// (`[rows][hidden_size]`) of the positions they ask for instead of logits: what an
    /// embedding model pools.
    pub fn hidden_states(&self, steps: &mut [Step<'_>]) -> Result<Vec<Vec<f32>>> {
        let rows = steps
            .iter_mut()
            .map(|s| StepRow {
                tokens: s.tokens,
                cache: &mut *s.cache,
                want: match s.logits {
                    LogitsRequest::None => Want::Nothing,
                    LogitsRequest::Last => Want::Hidden,
                    LogitsRequest::All => Want::AllHidden,
                },
                adapters: None,
            })
            .collect();
        Ok(self
            .execute(StepPlan::new(rows))?
            .into_iter()
            .map(|o| match o {
                RowOutput::Hidden(h) => h,
                _ => Vec::new(),
            })
            .collect())
    }
}

fn execute_on<B: CacheOf + LoraOf>(d: &Decoder<B>, plan: StepPlan<'_>) -> Result<Vec<RowOutput>> {
    let StepPlan { rows, masks } = plan;
    let mut batch = Vec::with_capacity(rows.len());
    for row in rows {
        let adapters = match row.adapters {
            Some(stack) => stack
                .adapters()
                .iter()
                .map(|a| B::lora_of(a.weights()))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        batch.push(BatchItem {
            tokens: row.tokens,
            cache: B::unwrap(&mut row.cache.inner)?,
            want: row.want,
            adapters,
        });
    }
    d.execute(&mut batch, masks)
}
