//! [`Model`]'s argmax pass over every requested row: greedy rows verify their drafts
//! (speculative decoding) with only the ids leaving the backend, no logits.
use super::adapters::stacks_of;
use super::dispatch::{batch_of, with_decoder, AnyDecoder, CacheOf};
use super::{Model, Step};
use crate::adapters::{AdapterStack, LoraOf};
use crate::models::decoder::{Decoder, LogitsRequest};
use crate::Result;

impl Model {
    /// [`Model::forward_argmax`] (with adapters, as [`Model::forward_adapters`]) that also
    /// takes steps asking for [`LogitsRequest::All`]: for each
    /// step, the argmax of every row it asks for (one for `Last`, one per fed token for
    /// `All`, none for `None`), picked on the backend.
    pub fn forward_argmax_rows(
        &self,
        steps: &mut [Step<'_>],
        adapters: &[&AdapterStack],
    ) -> Result<Vec<Vec<u32>>> {
        with_decoder!(&self.decoder, d => rows_on(d, steps, adapters))
    }
}

fn rows_on<B: CacheOf + LoraOf>(
    d: &Decoder<B>,
    steps: &mut [Step<'_>],
    adapters: &[&AdapterStack],
) -> Result<Vec<Vec<u32>>> {
    let stacks = stacks_of::<B>(adapters)?;
    if steps.iter().all(|s| s.logits == LogitsRequest::None) {
        d.forward_lora(&mut batch_of(steps)?, &stacks)?;
        return Ok(vec![Vec::new(); steps.len()]);
    }
    let (ids, rows) = d.forward_argmax_rows(&mut batch_of(steps)?, &stacks)?;
    let mut ids = d.backend().ids_to_host(&ids)?.into_iter();
    Ok(rows
        .into_iter()
        .map(|n| ids.by_ref().take(n).collect())
        .collect())
}
