//! [`PrefixIndex`]: which stored token sequences share the longest prefix with a prompt,
//! by chained block hashes, so a 16k-token lookup touches a few hundred hashes instead
//! of every token of every entry.
//!
//! Each entry's tokens are cut into blocks of [`BLOCK`] tokens; block `k`'s key is the
//! hash of the block seeded with block `k-1`'s key (block 0 is seeded with the
//! namespace), so a key stands for the whole prefix up to and including its block. A
//! prompt's keys are looked up until the first one no entry has; entries under the
//! deepest key found share at least that many full blocks, and only the tokens after
//! them are compared. The winner is always checked token by token, so a hash collision
//! can cost time but never return a wrong match.
use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per hashed block.
pub const BLOCK: usize = 64;

fn token_bytes(tokens: &[u32]) -> &[u8] {
    bytemuck::cast_slice(tokens)
}

fn ns_seed(ns: &str) -> u64 {
    xxh3_64(ns.as_bytes())
}

/// Chained keys of every full block of `tokens`.
fn chain(ns: &str, tokens: &[u32]) -> Vec<u64> {
    let mut h = ns_seed(ns);
    tokens
        .chunks_exact(BLOCK)
        .map(|b| {
            h = xxh3_64_with_seed(token_bytes(b), h);
            h
        })
        .collect()
}

fn exact_key(ns: &str, tokens: &[u32]) -> u64 {
    xxh3_64_with_seed(token_bytes(tokens), ns_seed(ns) ^ tokens.len() as u64)
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    // Compare 16 tokens at a time, then finish in the differing chunk.
    let mut i = 0;
    while i + 16 <= n && a[i..i + 16] == b[i..i + 16] {
        i += 16;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

struct Indexed {
    ns: Arc<str>,
    tokens: Arc<[u32]>,
    chain: Vec<u64>,
    exact: u64,
}

/// A namespaced index of token sequences by id.
pub struct PrefixIndex<Id> {
    entries: HashMap<Id, Indexed>,
    blocks: HashMap<u64, Vec<Id>>,
    exact: HashMap<u64, Vec<Id>>,
    by_ns: HashMap<Arc<str>, HashSet<Id>>,
}

impl<Id> Default for PrefixIndex<Id> {
    fn default() -> Self {
        PrefixIndex {
            entries: HashMap::new(),
            blocks: HashMap::new(),
            exact: HashMap::new(),
            by_ns: HashMap::new(),
        }
    }
}

fn remove_id<Id: PartialEq>(map: &mut HashMap<u64, Vec<Id>>, key: u64, id: &Id) {
    if let Some(v) = map.get_mut(&key) {
        v.retain(|x| x != id);
        if v.is_empty() {
            map.remove(&key);
        }
    }
}

impl<Id: Copy + Eq + Hash> PrefixIndex<Id> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds (or replaces) entry `id`.
    pub fn insert(&mut self, id: Id, ns: Arc<str>, tokens: Arc<[u32]>) {
        self.remove(id);
        let chain = chain(&ns, &tokens);
        let exact = exact_key(&ns, &tokens);
        for &k in &chain {
            self.blocks.entry(k).or_default().push(id);
        }
        self.exact.entry(exact).or_default().push(id);
        self.by_ns.entry(ns.clone()).or_default().insert(id);
        self.entries.insert(
            id,
            Indexed {
                ns,
                tokens,
                chain,
                exact,
            },
        );
    }

    /// Removes entry `id`, returning its namespace and tokens.
    pub fn remove(&mut self, id: Id) -> Option<(Arc<str>, Arc<[u32]>)> {
        let e = self.entries.remove(&id)?;
        for &k in &e.chain {
            remove_id(&mut self.blocks, k, &id);
        }
        remove_id(&mut self.exact, e.exact, &id);
        if let Some(set) = self.by_ns.get_mut(&e.ns) {
            set.remove(&id);
            if set.is_empty() {
                self.by_ns.remove(&e.ns);
            }
        }
        Some((e.ns, e.tokens))
    }

    /// The namespace and tokens of entry `id`.
    pub fn get(&self, id: Id) -> Option<(&Arc<str>, &Arc<[u32]>)> {
        self.entries.get(&id).map(|e| (&e.ns, &e.tokens))
    }

    /// Ids of the entries of namespace `ns`.
    pub fn ids_in(&self, ns: &str) -> Vec<Id> {
        self.by_ns
            .get(ns)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Entries of `ns` holding exactly `tokens`.
    pub fn exact(&self, ns: &str, tokens: &[u32]) -> Vec<Id> {
        let Some(ids) = self.exact.get(&exact_key(ns, tokens)) else {
            return Vec::new();
        };
        ids.iter()
            .copied()
            .filter(|id| {
                let e = &self.entries[id];
                &*e.ns == ns && *e.tokens == *tokens
            })
            .collect()
    }

    /// Entries of `ns` longer than `tokens` that start with them.
    pub fn descendants(&self, ns: &str, tokens: &[u32]) -> Vec<Id> {
        let full = tokens.len() / BLOCK;
        let candidates: Vec<Id> = if full == 0 {
            self.ids_in(ns)
        } else {
            let keys = chain(ns, &tokens[..full * BLOCK]);
            self.blocks
                .get(&keys[full - 1])
                .cloned()
                .unwrap_or_default()
        };
        candidates
            .into_iter()
            .filter(|id| {
                let e = &self.entries[id];
                &*e.ns == ns && e.tokens.len() > tokens.len() && e.tokens[..tokens.len()] == *tokens
            })
            .collect()
    }

    /// Entries of `ns` shorter than `tokens` that are a prefix of them.
    pub fn ancestors(&self, ns: &str, tokens: &[u32]) -> Vec<Id> {
        let keys = chain(ns, tokens);
        let Some(set) = self.by_ns.get(ns) else {
            return Vec::new();
        };
        set.iter()
            .copied()
            .filter(|id| {
                let e = &self.entries[id];
                e.tokens.len() < tokens.len()
                    && keys.starts_with(&e.chain)
                    && tokens[..e.tokens.len()] == *e.tokens
            })
            .collect()
    }

    /// The entry of `ns` with the most usable prefix of `prompt`. `usable(id, lcp)` says
    /// how many tokens entry `id`, sharing `lcp` tokens with the prompt, can give (never
    /// more than `lcp`), or `None` when it can give none. Ties go to the first found.
    pub fn best(
        &self,
        ns: &str,
        prompt: &[u32],
        mut usable: impl FnMut(Id, usize) -> Option<usize>,
    ) -> Option<(Id, usize)> {
        let keys = chain(ns, prompt);
        let found = self.search(ns, prompt, &keys, false, &mut usable);
        match found {
            Some((id, n)) if self.entries[&id].tokens[..n] == prompt[..n] => Some((id, n)),
            Some(_) => {
                // A block-hash collision fooled the fast path: compare every token.
                self.search(ns, prompt, &keys, true, &mut usable)
            }
            None => None,
        }
    }

    fn search(
        &self,
        ns: &str,
        prompt: &[u32],
        keys: &[u64],
        compare_all: bool,
        usable: &mut impl FnMut(Id, usize) -> Option<usize>,
    ) -> Option<(Id, usize)> {
        let mut depth = 0;
        while depth < keys.len() && self.blocks.contains_key(&keys[depth]) {
            depth += 1;
        }
        let mut seen: HashSet<Id> = HashSet::new();
        let mut best: Option<(Id, usize)> = None;
        let empty = HashSet::new();
        for d in (0..=depth).rev() {
            let candidates: Box<dyn Iterator<Item = Id> + '_> = if d == 0 {
                Box::new(self.by_ns.get(ns).unwrap_or(&empty).iter().copied())
            } else {
                Box::new(self.blocks[&keys[d - 1]].iter().copied())
            };
            for id in candidates {
                if !seen.insert(id) {
                    continue;
                }
                let e = &self.entries[&id];
                if &*e.ns != ns {
                    continue;
                }
                let lcp = if compare_all {
                    common_prefix(&e.tokens, prompt)
                } else {
                    let shared_blocks =
                        e.chain.iter().zip(keys).take_while(|(a, b)| a == b).count();
                    let from = shared_blocks * BLOCK;
                    from + common_prefix(&e.tokens[from..], &prompt[from..])
                };
                if let Some(n) = usable(id, lcp) {
                    let n = n.min(lcp);
                    if best.is_none_or(|(_, b)| n > b) {
                        best = Some((id, n));
                    }
                }
            }
            // Entries not under this depth's key share fewer than `d` blocks.
            if best.is_some_and(|(_, b)| b >= d * BLOCK) {
                break;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(entries: &[(u32, &str, Vec<u32>)], ns: &str, prompt: &[u32]) -> usize {
        entries
            .iter()
            .filter(|e| e.1 == ns)
            .map(|e| common_prefix(&e.2, prompt))
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn finds_longest_across_blocks() {
        let mut idx = PrefixIndex::new();
        let long: Vec<u32> = (0..1000).collect();
        let mut other = long.clone();
        other[700] = 9999;
        idx.insert(1u32, "".into(), long[..300].into());
        idx.insert(2, "".into(), other.clone().into());
        idx.insert(3, "lora".into(), long.clone().into());
        let (id, n) = idx.best("", &long, |_, l| Some(l)).unwrap();
        assert_eq!((id, n), (2, 700));
        // Namespaces never mix.
        let (id, n) = idx.best("lora", &long, |_, l| Some(l)).unwrap();
        assert_eq!((id, n), (3, 1000));
        assert!(idx.best("x", &long, |_, l| Some(l)).is_none());
        // An unusable deep entry lets a shallower one win.
        let (id, n) = idx.best("", &long, |id, l| (id != 2).then_some(l)).unwrap();
        assert_eq!((id, n), (1, 300));
    }

    #[test]
    fn exact_descendants_ancestors() {
        let mut idx = PrefixIndex::new();
        let t: Vec<u32> = (0..200).collect();
        idx.insert(1u32, "".into(), t[..10].into());
        idx.insert(2, "".into(), t[..130].into());
        idx.insert(3, "".into(), t.clone().into());
        idx.insert(4, "a".into(), t.clone().into());
        assert_eq!(idx.exact("", &t[..130]), vec![2]);
        let mut d = idx.descendants("", &t[..10]);
        d.sort();
        assert_eq!(d, vec![2, 3]);
        let mut d = idx.descendants("", &t[..129]);
        d.sort();
        assert_eq!(d, vec![2, 3]);
        let mut a = idx.ancestors("", &t);
        a.sort();
        assert_eq!(a, vec![1, 2]);
        idx.remove(2);
        assert_eq!(idx.descendants("", &t[..129]), vec![3]);
        assert!(idx.exact("", &t[..130]).is_empty());
        assert_eq!(idx.len(), 3);
    }

    proptest! {
        /// The block-hash search equals a brute-force longest common prefix.
        #[test]
        fn best_equals_brute_force(
            entries in proptest::collection::vec(
                (0u8..2, 0usize..300, proptest::collection::vec(0u32..3, 0..80)), 0..12),
            prompt in proptest::collection::vec(0u32..3, 1..300),
        ) {
            let ns_names = ["", "x"];
            // Entries share a random part of the prompt, then go their own way.
            let list: Vec<(u32, &str, Vec<u32>)> = entries
                .iter()
                .enumerate()
                .map(|(i, (n, cut, tail))| {
                    let mut t = prompt[..(*cut).min(prompt.len())].to_vec();
                    t.extend_from_slice(tail);
                    (i as u32, ns_names[*n as usize], t)
                })
                .collect();
            let mut idx = PrefixIndex::new();
            for (id, ns, t) in &list {
                idx.insert(*id, (*ns).into(), t.clone().into());
            }
            for ns in ns_names {
                let want = naive(&list, ns, &prompt);
                let got = idx.best(ns, &prompt, |_, l| (l > 0).then_some(l)).map_or(0, |b| b.1);
                prop_assert_eq!(got, want);
            }
        }
    }
}
