//! [`RamTier`]: the byte-capped, LRU prefix cache of live KV values.
//!
//! Entries are whole sequences `(namespace, tokens, value)`. A lookup finds the entry
//! sharing the longest usable prefix with the prompt (capped at `prompt.len() - 1`, so
//! one prompt token is always recomputed and the first sampled token has fresh logits),
//! forks that prefix and leaves the donor in place, so many requests share one prefill.
//! A put replaces an identical entry, is skipped when a longer stored entry already
//! covers it, supersedes the shorter entries it covers, then evicts least-recently-used
//! entries until the byte cap holds; evicted entries go back to the caller (to spill).
//!
//! An entry may be pinned until some instant (an Anthropic `cache_control` breakpoint):
//! eviction takes unpinned entries first and a pinned one only when the pinned entries
//! alone are over the cap. A put that supersedes a pinned entry, or is covered by a longer
//! one, moves the pin to the entry that now serves its tokens.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::prefix_index::PrefixIndex;
use crate::value::{CacheValue, KvSnapshot};
use crate::{CacheError, Result};

/// Identifies an entry of a tier.
pub type EntryId = u64;

struct RamEntry<V> {
    value: V,
    bytes: usize,
    last_use: u64,
    /// Kept before unpinned entries until then.
    pinned_until: Option<Instant>,
}

impl<V> RamEntry<V> {
    fn pinned(&self, now: Instant) -> bool {
        self.pinned_until.is_some_and(|t| t > now)
    }
}

/// Why a lookup found nothing to reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// No entry shares a prefix with the prompt.
    NoEntry,
    /// An entry shares a prefix but cannot be cut back to it (a recurrent state, a
    /// sliding window that wrapped), and none ends exactly there.
    Untrimmable,
    /// Only entries of another namespace (another adapter stack, another client's
    /// `cache_namespace`) share a prefix.
    Namespace,
    /// An entry that shared a prefix was evicted for space.
    Evicted,
}

impl MissReason {
    /// Every reason, in the order metrics list them.
    pub const ALL: [MissReason; 4] = [
        MissReason::NoEntry,
        MissReason::Untrimmable,
        MissReason::Namespace,
        MissReason::Evicted,
    ];

    /// Its label in metrics.
    pub fn label(self) -> &'static str {
        match self {
            MissReason::NoEntry => "no_entry",
            MissReason::Untrimmable => "untrimmable",
            MissReason::Namespace => "namespace",
            MissReason::Evicted => "evicted",
        }
    }
}

/// Evicted entries' tokens remembered to tell an eviction miss from a cold prompt.
const EVICTED_MEMORY: usize = 64;

/// A usable prefix found by [`RamTier::best_match`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamMatch {
    /// The donor entry.
    pub id: EntryId,
    /// Tokens it can give.
    pub usable: usize,
}

/// An entry that left the RAM tier by eviction (the caller may spill it).
pub struct Evicted<V> {
    /// Its namespace.
    pub ns: Arc<str>,
    /// Its tokens.
    pub tokens: Arc<[u32]>,
    /// Its value.
    pub value: V,
}

/// What a [`RamTier::put`] did.
pub struct PutOutcome<V> {
    /// Whether the entry is now stored (false: covered by a longer entry, or too big).
    pub stored: bool,
    /// Shorter entries dropped because the new one covers them.
    pub superseded: usize,
    /// Entries evicted to stay under the cap (the new one too, when it alone is over).
    pub evicted: Vec<Evicted<V>>,
}

/// Counters of the RAM tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RamCounters {
    /// Entries held.
    pub entries: usize,
    /// Bytes held.
    pub bytes: u64,
    /// The byte cap.
    pub max_bytes: u64,
    /// Entries evicted for space, all time.
    pub evictions: u64,
    /// Entries dropped because a longer entry covers them, all time.
    pub superseded: u64,
    /// Entries pinned now.
    pub pinned_entries: usize,
    /// Bytes of the pinned entries.
    pub pinned_bytes: u64,
}

/// The RAM tier.
pub struct RamTier<V> {
    entries: HashMap<EntryId, RamEntry<V>>,
    index: PrefixIndex<EntryId>,
    lru: BTreeMap<u64, EntryId>,
    next_id: EntryId,
    clock: u64,
    bytes: usize,
    max_bytes: usize,
    evictions: u64,
    superseded: u64,
    /// The tokens of the latest evicted entries, newest last.
    evicted: VecDeque<(Arc<str>, Arc<[u32]>)>,
}

impl<V: CacheValue> RamTier<V> {
    /// An empty tier holding at most `max_bytes` (0 stores nothing).
    pub fn new(max_bytes: usize) -> Self {
        RamTier {
            entries: HashMap::new(),
            index: PrefixIndex::new(),
            lru: BTreeMap::new(),
            next_id: 1,
            clock: 0,
            bytes: 0,
            max_bytes,
            evictions: 0,
            superseded: 0,
            evicted: VecDeque::new(),
        }
    }

    /// Counters.
    pub fn counters(&self) -> RamCounters {
        let now = Instant::now();
        let pinned = self.entries.values().filter(|e| e.pinned(now));
        let (pinned_entries, pinned_bytes) =
            pinned.fold((0, 0u64), |(n, b), e| (n + 1, b + e.bytes as u64));
        RamCounters {
            entries: self.entries.len(),
            bytes: self.bytes as u64,
            max_bytes: self.max_bytes as u64,
            evictions: self.evictions,
            superseded: self.superseded,
            pinned_entries,
            pinned_bytes,
        }
    }

    /// Pins the entry serving exactly `tokens` of `ns` (or a longer one that can be cut
    /// back to them) until `until`, or later if it is pinned longer. Returns whether one
    /// was found.
    pub fn pin(&mut self, ns: &str, tokens: &[u32], until: Instant) -> bool {
        let id = self.index.exact(ns, tokens).first().copied().or_else(|| {
            self.index
                .descendants(ns, tokens)
                .into_iter()
                .find(|id| self.entries[id].value.can_trim_to(tokens.len()))
        });
        match id.and_then(|id| self.entries.get_mut(&id)) {
            Some(e) => {
                e.pinned_until = e.pinned_until.max(Some(until));
                true
            }
            None => false,
        }
    }

    /// Why nothing of `prompt` could be reused from `ns` (called after a miss).
    pub fn miss_reason(&self, ns: &str, prompt: &[u32]) -> MissReason {
        let shares = |tokens: &[u32]| crate::prefix_index::common_prefix(tokens, prompt) > 0;
        if self
            .index
            .best(ns, prompt, |_, lcp| (lcp > 0).then_some(lcp))
            .is_some()
        {
            return MissReason::Untrimmable;
        }
        if self.evicted.iter().any(|(n, t)| &**n == ns && shares(t)) {
            return MissReason::Evicted;
        }
        let elsewhere = self
            .entries
            .keys()
            .filter_map(|&id| self.index.get(id))
            .any(|(n, t)| &**n != ns && shares(t));
        if elsewhere {
            MissReason::Namespace
        } else {
            MissReason::NoEntry
        }
    }

    fn touch(&mut self, id: EntryId) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(e) = self.entries.get_mut(&id) {
            self.lru.remove(&e.last_use);
            e.last_use = clock;
            self.lru.insert(clock, id);
        }
    }

    /// Remembers an evicted entry's tokens (for [`Self::miss_reason`]).
    fn remember_eviction(&mut self, e: &Evicted<V>) {
        if self.evicted.len() == EVICTED_MEMORY {
            self.evicted.pop_front();
        }
        self.evicted.push_back((e.ns.clone(), e.tokens.clone()));
    }

    /// The least recently used entry to evict for `keep`'s sake: unpinned ones first.
    fn victim(&self, keep: EntryId) -> Option<EntryId> {
        let now = Instant::now();
        let unpinned = self
            .lru
            .values()
            .copied()
            .find(|id| *id != keep && !self.entries[id].pinned(now));
        unpinned.or_else(|| self.lru.values().copied().find(|id| *id != keep))
    }

    fn remove(&mut self, id: EntryId) -> Option<Evicted<V>> {
        let e = self.entries.remove(&id)?;
        self.lru.remove(&e.last_use);
        self.bytes -= e.bytes;
        let (ns, tokens) = self.index.remove(id)?;
        Some(Evicted {
            ns,
            tokens,
            value: e.value,
        })
    }

    /// The entry of `ns` that can give the most tokens of `prompt`: at most
    /// `prompt.len() - 1`, and an entry longer than that must be trimmable to it.
    pub fn best_match(&self, ns: &str, prompt: &[u32]) -> Option<RamMatch> {
        let cap = prompt.len().checked_sub(1)?;
        let (id, usable) = self.index.best(ns, prompt, |id, lcp| {
            let want = lcp.min(cap);
            let e = &self.entries[&id];
            (want > 0 && (e.value.len() == want || e.value.can_trim_to(want))).then_some(want)
        })?;
        Some(RamMatch { id, usable })
    }

    /// A fork of the first `m.usable` tokens of the matched entry, which becomes the most
    /// recently used.
    pub fn take(&mut self, m: &RamMatch) -> Result<V> {
        let value = self
            .entries
            .get(&m.id)
            .ok_or_else(|| CacheError::Value {
                op: "fork",
                reason: "the matched entry is gone".into(),
            })?
            .value
            .fork(m.usable)?;
        self.touch(m.id);
        Ok(value)
    }

    /// A fork of the entry holding exactly `tokens` in `ns`, if there is one.
    pub fn fork_exact(&self, ns: &str, tokens: &[u32]) -> Option<Result<V>> {
        let id = *self.index.exact(ns, tokens).first()?;
        let e = &self.entries[&id];
        Some(e.value.fork(tokens.len()))
    }

    /// A host copy of the entry holding exactly `tokens` in `ns`, if there is one.
    pub fn host_exact(&self, ns: &str, tokens: &[u32]) -> Option<Result<KvSnapshot>> {
        let id = *self.index.exact(ns, tokens).first()?;
        Some(self.entries[&id].value.to_host())
    }

    /// Whether an entry of `ns` holds `tokens` exactly, or holds more and can be cut back.
    pub fn covers(&self, ns: &str, tokens: &[u32]) -> bool {
        !self.index.exact(ns, tokens).is_empty()
            || self
                .index
                .descendants(ns, tokens)
                .iter()
                .any(|id| self.entries[id].value.can_trim_to(tokens.len()))
    }

    /// Stores `value`, which holds exactly `tokens`, under `ns`.
    pub fn put(&mut self, ns: &str, tokens: &[u32], value: V) -> Result<PutOutcome<V>> {
        if value.len() != tokens.len() {
            return Err(CacheError::LengthMismatch {
                tokens: tokens.len(),
                cached: value.len(),
            });
        }
        let mut out = PutOutcome {
            stored: false,
            superseded: 0,
            evicted: Vec::new(),
        };
        if self.max_bytes == 0 || tokens.is_empty() {
            return Ok(out);
        }
        // A longer entry that can be cut back to these tokens already serves them.
        if let Some(&id) = self
            .index
            .descendants(ns, tokens)
            .iter()
            .find(|id| self.entries[id].value.can_trim_to(tokens.len()))
        {
            self.touch(id);
            return Ok(out);
        }
        // Pins of the entries this one replaces or supersedes move to it.
        let mut pinned_until = None;
        for id in self.index.exact(ns, tokens) {
            pinned_until = pinned_until.max(self.entries.get(&id).and_then(|e| e.pinned_until));
            self.remove(id);
        }
        for id in self.index.ancestors(ns, tokens) {
            let len = self.index.get(id).map_or(0, |(_, t)| t.len());
            if value.can_trim_to(len) {
                pinned_until = pinned_until.max(self.entries.get(&id).and_then(|e| e.pinned_until));
                self.remove(id);
                out.superseded += 1;
                self.superseded += 1;
            }
        }
        let bytes = value.byte_size();
        let id = self.next_id;
        self.next_id += 1;
        self.index.insert(id, ns.into(), tokens.into());
        self.entries.insert(
            id,
            RamEntry {
                value,
                bytes,
                last_use: 0,
                pinned_until,
            },
        );
        self.bytes += bytes;
        self.touch(id);
        out.stored = true;
        if bytes > self.max_bytes {
            out.stored = false;
            out.evicted.extend(self.remove(id));
            return Ok(out);
        }
        while self.bytes > self.max_bytes {
            let Some(victim) = self.victim(id) else {
                break;
            };
            if let Some(e) = self.remove(victim) {
                self.remember_eviction(&e);
                out.evicted.push(e);
            }
            self.evictions += 1;
        }
        Ok(out)
    }

    /// Removes every entry, handing them back (shutdown spills).
    pub fn drain(&mut self) -> Vec<Evicted<V>> {
        let ids: Vec<EntryId> = self.lru.values().copied().collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::testing::FakeKv;

    fn kv(t: &[u32]) -> FakeKv {
        FakeKv::new(t, None)
    }

    #[test]
    fn reuses_the_longest_prefix_minus_one() {
        let mut ram = RamTier::new(1 << 20);
        let t: Vec<u32> = (0..100).collect();
        ram.put("", &t[..50], kv(&t[..50])).unwrap();
        let m = ram.best_match("", &t).unwrap();
        assert_eq!(m.usable, 50);
        // The same prompt again: one token is always recomputed.
        let m = ram.best_match("", &t[..50]).unwrap();
        assert_eq!(m.usable, 49);
        let v = ram.take(&m).unwrap();
        assert_eq!(v.stored_tokens(), t[..49].to_vec());
        // The donor stays.
        assert_eq!(ram.counters().entries, 1);
        assert!(ram.best_match("", &t[..1]).is_none());
        assert!(ram.best_match("other", &t).is_none());
    }

    #[test]
    fn untrimmable_entries_only_serve_their_exact_length() {
        let mut ram = RamTier::new(1 << 20);
        let t: Vec<u32> = (0..100).collect();
        // A wrapped ring of 100 tokens: cannot be cut back.
        ram.put("", &t, FakeKv::new(&t, Some(16))).unwrap();
        let mut prompt = t[..80].to_vec();
        prompt.push(7777);
        assert!(ram.best_match("", &prompt).is_none());
        // A prompt-boundary entry next to it still serves the shorter prompt.
        ram.put("", &t[..60], kv(&t[..60])).unwrap();
        assert_eq!(ram.best_match("", &prompt).unwrap().usable, 60);
        // The full sequence plus more hits the ring exactly.
        let mut longer = t.clone();
        longer.push(5);
        assert_eq!(ram.best_match("", &longer).unwrap().usable, 100);
    }

    #[test]
    fn supersedes_covered_ancestors_and_skips_covered_puts() {
        let mut ram = RamTier::new(1 << 20);
        let t: Vec<u32> = (0..300).collect();
        ram.put("", &t[..100], kv(&t[..100])).unwrap();
        ram.put("x", &t[..100], kv(&t[..100])).unwrap();
        let out = ram.put("", &t, kv(&t)).unwrap();
        assert!(out.stored);
        assert_eq!(out.superseded, 1);
        assert_eq!(ram.counters().entries, 2);
        let out = ram.put("", &t[..200], kv(&t[..200])).unwrap();
        assert!(!out.stored);
        assert_eq!(ram.counters().entries, 2);
        // An untrimmable newcomer does not supersede.
        let mut u = t.clone();
        u.extend(1000..1100);
        let out = ram.put("", &u, FakeKv::new(&u, Some(16))).unwrap();
        assert_eq!(out.superseded, 0);
        assert_eq!(ram.counters().entries, 3);
        assert!(ram.covers("", &t[..10]));
        assert!(!ram.covers("y", &t[..10]));
    }

    #[test]
    fn evicts_least_recently_used_under_the_cap() {
        let size = kv(&[0; 10]).snapshot.byte_size();
        let mut ram = RamTier::new(size * 3);
        for i in 0..3u32 {
            ram.put("", &[i; 10], kv(&[i; 10])).unwrap();
        }
        // Use entry 0, so entry 1 is the oldest.
        let m = ram.best_match("", &[0; 11]).unwrap();
        ram.take(&m).unwrap();
        let out = ram.put("", &[9; 10], kv(&[9; 10])).unwrap();
        assert_eq!(out.evicted.len(), 1);
        assert_eq!(*out.evicted[0].tokens, [1; 10]);
        assert_eq!(ram.counters().bytes as usize, size * 3);
        // Too big for the cap: handed straight back.
        let big: Vec<u32> = vec![4; 40];
        let out = ram.put("", &big, kv(&big)).unwrap();
        assert!(!out.stored);
        assert_eq!(out.evicted.len(), 1);
        assert_eq!(ram.counters().entries, 3);
    }

    #[test]
    fn zero_cap_stores_nothing() {
        let mut ram = RamTier::new(0);
        let out = ram.put("", &[1, 2], kv(&[1, 2])).unwrap();
        assert!(!out.stored && out.evicted.is_empty());
        assert!(ram.put("", &[1], kv(&[1, 2])).is_err());
    }

    #[test]
    fn pinned_entries_outlast_unpinned_ones_until_they_expire() {
        let one = kv(&[1; 10]).byte_size();
        let mut ram = RamTier::new(3 * one);
        let later = Instant::now() + std::time::Duration::from_secs(300);
        ram.put("", &[1; 10], kv(&[1; 10])).unwrap();
        assert!(ram.pin("", &[1; 10], later));
        ram.put("", &[2; 10], kv(&[2; 10])).unwrap();
        ram.put("", &[3; 10], kv(&[3; 10])).unwrap();
        // Over the cap: the oldest unpinned entry goes, not the older pinned one.
        let out = ram.put("", &[4; 10], kv(&[4; 10])).unwrap();
        assert_eq!(&*out.evicted[0].tokens, &[2; 10]);
        assert!(ram.best_match("", &[1; 11]).is_some());
        assert_eq!(ram.counters().pinned_entries, 1);
        // An expired pin is an ordinary entry again.
        assert!(ram.pin("", &[1; 10], Instant::now()));
        ram.entries
            .values_mut()
            .for_each(|e| e.pinned_until = Some(Instant::now()));
        let out = ram.put("", &[5; 10], kv(&[5; 10])).unwrap();
        assert_eq!(&*out.evicted[0].tokens, &[1; 10]);
    }

    #[test]
    fn a_pin_moves_to_the_entry_that_supersedes_its_own() {
        let mut ram = RamTier::new(1 << 20);
        let t: Vec<u32> = (0..40).collect();
        ram.put("", &t[..20], kv(&t[..20])).unwrap();
        ram.pin(
            "",
            &t[..20],
            Instant::now() + std::time::Duration::from_secs(60),
        );
        ram.put("", &t, kv(&t)).unwrap();
        assert_eq!(ram.counters().entries, 1);
        assert_eq!(ram.counters().pinned_entries, 1);
        // A prefix a longer entry serves can be pinned through it.
        assert!(ram.pin(
            "",
            &t[..30],
            Instant::now() + std::time::Duration::from_secs(60)
        ));
        assert!(!ram.pin("", &[9, 9], Instant::now()));
    }

    #[test]
    fn a_miss_says_why() {
        let one = kv(&[1; 10]).byte_size();
        let mut ram = RamTier::new(2 * one);
        let t: Vec<u32> = (0..10).collect();
        let prompt: Vec<u32> = t[..6].iter().copied().chain([77, 78]).collect();
        assert_eq!(ram.miss_reason("", &prompt), MissReason::NoEntry);
        ram.put("adapter", &t, kv(&t)).unwrap();
        assert_eq!(ram.miss_reason("", &prompt), MissReason::Namespace);
        ram.put("", &t, FakeKv::new(&t, Some(2))).unwrap();
        assert!(ram.best_match("", &prompt).is_none());
        assert_eq!(ram.miss_reason("", &prompt), MissReason::Untrimmable);
        // Evicted: the shared entry leaves for two others.
        ram.put("", &[50; 10], kv(&[50; 10])).unwrap();
        ram.put("", &[60; 10], kv(&[60; 10])).unwrap();
        assert_eq!(ram.miss_reason("", &prompt), MissReason::Evicted);
    }
}
