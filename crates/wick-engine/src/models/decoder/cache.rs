//! [`SequenceCache`]: one sequence's KV layers, recurrent states and media rows.
use crate::backend::{Backend, KvLayer, KvLayerSnapshot};
use crate::models::recurrent::RecurrentCache;
use crate::models::vision::ImageRows;
use crate::{EngineError, Result};

/// The KV cache of one sequence: one backend cache per layer.
pub struct SequenceCache<B: Backend> {
    pub(super) layers: Vec<B::KvLayer>,
    /// The recurrent states of a hybrid model's linear-attention layers (Qwen 3.5);
    /// `layers` then holds its full-attention layers only.
    pub(super) recurrent: Option<RecurrentCache<B::DeltaState>>,
    /// The projected rows of the sequence's images, placed by the passes that reach them.
    pub(super) images: Vec<ImageRows>,
}

impl<B: Backend> Clone for SequenceCache<B> {
    fn clone(&self) -> Self {
        SequenceCache {
            layers: self.layers.clone(),
            recurrent: self.recurrent.clone(),
            images: self.images.clone(),
        }
    }
}

impl<B: Backend> SequenceCache<B> {
    /// Tokens the cache holds (the next position).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the cache can be cut back to `len` tokens.
    pub fn can_trim_to(&self, len: usize) -> bool {
        self.layers.iter().all(|l| l.can_trim_to(len))
            && self.recurrent.as_ref().is_none_or(|r| r.can_trim_to(len))
    }

    /// Forgets everything from position `len` on.
    pub fn trim(&mut self, len: usize) -> Result<()> {
        if !self.can_trim_to(len) {
            return Err(EngineError::Cache(format!(
                "cannot trim {} cached tokens to {len}",
                self.len()
            )));
        }
        self.layers.iter_mut().try_for_each(|l| l.trim(len))
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        self.layers.iter().map(|l| l.byte_size()).sum::<usize>()
            + self.recurrent.as_ref().map_or(0, RecurrentCache::byte_size)
    }

    /// Host copies of every layer.
    pub fn snapshot(&self) -> Vec<KvLayerSnapshot> {
        self.layers.iter().map(|l| l.snapshot()).collect()
    }

    /// The recurrent states, for a hybrid model.
    pub fn recurrent(&self) -> Option<&RecurrentCache<B::DeltaState>> {
        self.recurrent.as_ref()
    }

    /// The recurrent states, mutably.
    pub fn recurrent_mut(&mut self) -> Option<&mut RecurrentCache<B::DeltaState>> {
        self.recurrent.as_mut()
    }

    /// The sequence's images (their projected rows and prompt positions).
    pub fn images(&self) -> &[ImageRows] {
        &self.images
    }

    /// Sets the sequence's images (see [`super::Decoder::embed_media`]).
    pub fn set_images(&mut self, images: Vec<ImageRows>) {
        self.images = images;
    }

    /// The per-layer caches (for backend bookkeeping such as KV block leases).
    pub fn layers(&self) -> &[B::KvLayer] {
        &self.layers
    }

    /// The per-layer caches, mutably.
    pub fn layers_mut(&mut self) -> &mut [B::KvLayer] {
        &mut self.layers
    }
}
