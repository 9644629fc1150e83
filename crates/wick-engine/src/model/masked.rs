//! [`Model`]'s argmax pass under token masks: structured output's greedy rows picked on
//! the backend, so their logits never leave the device.
use super::adapters::stacks_of;
use super::dispatch::{batch_of, spread_ids, token_steps, with_decoder, AnyDecoder, CacheOf};
use super::{Model, Step};
use crate::adapters::{AdapterStack, LoraOf};
use crate::models::decoder::Decoder;
use crate::Result;

impl Model {
    /// Whether structured output's greedy rows are better picked by
    /// [`Model::forward_argmax_masked`] than sampled on the host: on a device backend,
    /// where the logits would otherwise cross to the host every step. On the CPU, checking
    /// the sampled token first usually needs no mask at all.
    pub fn prefers_backend_masks(&self) -> bool {
        !matches!(self.decoder, AnyDecoder::Candle(_))
    }

    /// [`Model::forward_argmax`] (with adapters, as [`Model::forward_adapters`]) where the
    /// token of step `i` is the argmax of its logits under the mask `masks()[i]` (bit
    /// words, see [`crate::backend::Backend::masked_argmax`]; `None`: unmasked). `masks`
    /// is called once the pass is started on the backend, so a device backend computes
    /// the logits while the host computes the masks.
    pub fn forward_argmax_masked(
        &self,
        steps: &mut [Step<'_>],
        adapters: &[&AdapterStack],
        masks: impl FnOnce() -> Vec<Option<Vec<u32>>>,
    ) -> Result<Vec<Option<u32>>> {
        with_decoder!(&self.decoder, d => masked_on(d, steps, adapters, masks))
    }
}

fn masked_on<B: CacheOf + LoraOf>(
    d: &Decoder<B>,
    steps: &mut [Step<'_>],
    adapters: &[&AdapterStack],
    masks: impl FnOnce() -> Vec<Option<Vec<u32>>>,
) -> Result<Vec<Option<u32>>> {
    let wants = token_steps(steps);
    let stacks = stacks_of::<B>(adapters)?;
    if !wants.contains(&true) {
        d.forward_lora(&mut batch_of(steps)?, &stacks)?;
        let _ = masks();
        return Ok(vec![None; steps.len()]);
    }
    let ids = d.forward_argmax_masked(&mut batch_of(steps)?, &stacks, masks)?;
    Ok(spread_ids(wants, d.backend().ids_to_host(&ids)?))
}
