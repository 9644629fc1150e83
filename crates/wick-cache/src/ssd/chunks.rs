//! Which rows of an entry go to shared chunk files, and what the chunks are called.
//!
//! An agent resends its whole conversation every turn, so consecutive entries share all but
//! their last few hundred tokens. The SSD tier therefore stores the KV of each run of
//! [`CHUNK_TOKENS`] positions once, in a chunk file named by a chained hash of every token
//! up to and including the run: chunk `k` of a group of layers is named
//! `link(name of chunk k-1, its tokens)`, and the chain starts from a seed of the namespace
//! the KV was computed under, the chunk size, the group's window and its layers' shapes.
//! Two entries whose tokens agree up to a chunk's end name the same chunk file, so a turn
//! writes only the chunks its new tokens complete and an entry file with the rest.
//!
//! Layers are grouped by window: full-attention layers hold every position, a sliding-window
//! layer only its last positions, so each group is chunked over the whole chunks its layers
//! all still hold. Rows outside every chunk (a group's first and last partial chunk) and the
//! recurrent state of a hybrid model (which summarizes every token and cannot be split by
//! position) stay in the entry file.
use xxhash_rust::xxh3::xxh3_128;

use super::format::{ChunkGroup, FileHeader, CHUNK_EXTENSION};
use crate::value::KvSnapshot;

/// Tokens per chunk (the prefix index's block size, so the two agree on boundaries).
pub const CHUNK_TOKENS: usize = crate::prefix_index::BLOCK;

/// A chunk's name: the chain hash of every token up to its end.
pub type ChunkId = u128;

/// The file name of chunk `id`.
pub fn file_name(id: ChunkId) -> String {
    format!("{id:032x}.{CHUNK_EXTENSION}")
}

/// The chunk a file name names, if it is one of ours (32 lower-case hex digits, `.wkc`).
pub fn parse_file_name(name: &str) -> Option<ChunkId> {
    let hex = name.strip_suffix(CHUNK_EXTENSION)?.strip_suffix('.')?;
    is_hex32(hex)
        .then(|| u128::from_str_radix(hex, 16).ok())
        .flatten()
}

/// Whether `s` is 32 lower-case hex digits (the names the tier gives its files).
pub fn is_hex32(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The next link of a chain: the hash of the previous link and the tokens after it.
pub fn link(parent: ChunkId, tokens: &[u32]) -> ChunkId {
    let mut bytes = Vec::with_capacity(16 + tokens.len() * 4);
    bytes.extend_from_slice(&parent.to_le_bytes());
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    xxh3_128(&bytes)
}

/// The start of a group's chain. `layers` are `(index, kv_heads, head_dim)`.
fn seed(
    kv_namespace: &str,
    chunk_tokens: usize,
    window: Option<usize>,
    layers: &[(usize, usize, usize)],
) -> ChunkId {
    let mut bytes = b"wick-kv-chunks/1\0".to_vec();
    bytes.extend_from_slice(&(kv_namespace.len() as u64).to_le_bytes());
    bytes.extend_from_slice(kv_namespace.as_bytes());
    bytes.extend_from_slice(&(chunk_tokens as u64).to_le_bytes());
    bytes.extend_from_slice(&window.map_or(u64::MAX, |w| w as u64).to_le_bytes());
    for &(i, heads, dim) in layers {
        for x in [i, heads, dim] {
            bytes.extend_from_slice(&(x as u64).to_le_bytes());
        }
    }
    xxh3_128(&bytes)
}

/// One chunk an entry refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRef {
    /// Index of its group in the entry's [`super::format::ChunkRefs::groups`].
    pub group: usize,
    /// First position.
    pub from: usize,
    /// End position.
    pub to: usize,
    /// The chain hash before it.
    pub parent: ChunkId,
    /// Its name.
    pub id: ChunkId,
}

/// Every chunk an entry refers to, group by group, in position order (none for an entry that
/// holds all of its rows). Derived from the header's tokens and shapes alone, so writing,
/// scanning and restoring name the same files.
pub fn refs(h: &FileHeader) -> Vec<ChunkRef> {
    let Some(c) = &h.chunks else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (g, group) in c.groups.iter().enumerate() {
        let shapes: Vec<(usize, usize, usize)> = group
            .layers
            .iter()
            .filter_map(|&i| h.layers.get(i).map(|l| (i, l.kv_heads, l.head_dim)))
            .collect();
        let window = group
            .layers
            .first()
            .and_then(|&i| h.layers.get(i))
            .and_then(|l| l.window);
        let mut id = seed(&c.kv_namespace, c.chunk_tokens, window, &shapes);
        let mut at = 0;
        while at + c.chunk_tokens <= group.to.min(h.tokens.len()) {
            let parent = id;
            let end = at + c.chunk_tokens;
            id = link(parent, &h.tokens[at..end]);
            if at >= group.from {
                out.push(ChunkRef {
                    group: g,
                    from: at,
                    to: end,
                    parent,
                    id,
                });
            }
            at = end;
        }
    }
    out
}

/// How to chunk `snap` with chunks of `chunk_tokens`: layers grouped by window, each group
/// over the whole chunks every one of its layers still stores. Groups without a whole chunk
/// are left out (their layers stay in the entry).
pub fn groups(snap: &KvSnapshot, chunk_tokens: usize) -> Vec<ChunkGroup> {
    if chunk_tokens == 0 {
        return Vec::new();
    }
    let mut windows: Vec<Option<usize>> = Vec::new();
    for l in &snap.layers {
        if !windows.contains(&l.window) {
            windows.push(l.window);
        }
    }
    let len = snap.len();
    windows
        .into_iter()
        .filter_map(|w| {
            let layers: Vec<usize> = (0..snap.layers.len())
                .filter(|&i| snap.layers[i].window == w)
                .collect();
            let start = layers.iter().map(|&i| snap.layers[i].start).max()?;
            let from = start.div_ceil(chunk_tokens) * chunk_tokens;
            let to = len / chunk_tokens * chunk_tokens;
            (from < to).then_some(ChunkGroup { layers, from, to })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssd::format::{plan, ChunkRefs, EntryLabel};
    use crate::value::testing::FakeKv;

    fn header(tokens: &[u32], snap: &KvSnapshot, ns: &str) -> FileHeader {
        let label = EntryLabel {
            fingerprint: "fp",
            model: "m",
            namespace: ns,
            tokens,
            checkpoint: None,
        };
        let groups = groups(snap, 8);
        plan(
            &label,
            snap,
            0,
            Some(ChunkRefs {
                chunk_tokens: 8,
                kv_namespace: ns.into(),
                groups,
            }),
        )
        .unwrap()
    }

    #[test]
    fn names_follow_the_prefix_and_nothing_else() {
        assert_eq!(parse_file_name(&file_name(0xabc)), Some(0xabc));
        assert_eq!(parse_file_name("ABC.wkc"), None);
        assert_eq!(parse_file_name(&format!("{}.wkv", "0".repeat(32))), None);
        assert_eq!(parse_file_name(&format!("{}.wkc", "G".repeat(32))), None);

        let a: Vec<u32> = (0..30).collect();
        let mut b = a.clone();
        b[20] = 999;
        let ra = refs(&header(&a, &FakeKv::new(&a, None).snapshot, ""));
        let rb = refs(&header(&b, &FakeKv::new(&b, None).snapshot, ""));
        // 30 tokens: chunks 0..8, 8..16, 16..24; the last 6 stay in the entry.
        assert_eq!(
            ra.iter().map(|r| (r.from, r.to)).collect::<Vec<_>>(),
            [(0, 8), (8, 16), (16, 24)]
        );
        // The same prefix names the same chunks; a change names every chunk from it on anew.
        assert_eq!(ra[..2], rb[..2]);
        assert_ne!(ra[2].id, rb[2].id);
        assert_eq!(ra[1].parent, ra[0].id);
        // Another namespace's KV never shares a chunk.
        let rn = refs(&header(&a, &FakeKv::new(&a, None).snapshot, "lora"));
        assert!(rn.iter().zip(&ra).all(|(x, y)| x.id != y.id));
    }

    #[test]
    fn a_wrapped_window_chunks_only_what_it_still_holds() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut snap = FakeKv::new(&tokens, None).snapshot;
        let ring = FakeKv::new(&tokens, Some(16)).snapshot.layers.remove(0);
        assert_eq!(ring.start, 85);
        snap.layers.push(ring);
        let g = groups(&snap, 8);
        // Full attention: 0..96. The ring (from 85): 88..96.
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].layers.clone(), g[0].from, g[0].to), (vec![0], 0, 96));
        assert_eq!((g[1].layers.clone(), g[1].from, g[1].to), (vec![1], 88, 96));
        let h = header(&tokens, &snap, "");
        let r = refs(&h);
        assert_eq!(r.iter().filter(|r| r.group == 1).count(), 1);
        // The ring's chain still covers every token before its first chunk.
        let ring_ref = r.iter().find(|r| r.group == 1).unwrap();
        assert_eq!((ring_ref.from, ring_ref.to), (88, 96));
        assert_ne!(
            ring_ref.id,
            r.iter().find(|r| r.group == 0 && r.from == 88).unwrap().id
        );
        assert!(groups(&snap, 0).is_empty());
    }
}
