//! Prompt attention on the tensor cores: the flash kernels of `kernels.cu` (`flash_*`), for
//! the segments of a pass with many new rows (prompt chunks). See `docs/gpu.md`.
use wick_cuda::{Arg, Buffer, Kernel};

use super::{cuda_err, int, CudaBackend, CudaTensor, Seg, Tile};
use crate::Result;

/// How prompt chunks attend (`WICK_CUDA_FLASH`: `off`, `fast`, `exact`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttention {
    /// Every row on the f32 kernels of the CUDA cores (the decode kernels).
    Off,
    /// Tensor cores with f16 products and f32 sums, as llama.cpp's and FlashAttention's
    /// kernels: queries, probabilities (and f32 keys and values) rounded to f16, about
    /// 2⁻¹¹ of each product.
    Fast,
    /// Tensor cores with each f16 operand carried as a pair hi + lo: products as exact as
    /// f32 ones, at two (f16 caches) or three (f32 caches) times the tensor-core work.
    Exact,
}

impl FlashAttention {
    /// The mode `WICK_CUDA_FLASH` names (`0`/`off`, `fast`, `exact`); unset: [`Fast`].
    ///
    /// [`Fast`]: FlashAttention::Fast
    pub fn from_env() -> Self {
        match std::env::var("WICK_CUDA_FLASH").as_deref() {
            Ok("0" | "off") => FlashAttention::Off,
            Ok("exact") => FlashAttention::Exact,
            Ok("" | "1" | "fast") | Err(_) => FlashAttention::Fast,
            Ok(other) => {
                tracing::warn!("WICK_CUDA_FLASH={other}: expected off, fast or exact; using fast");
                FlashAttention::Fast
            }
        }
    }
}

/// Segments with at least this many new rows attend on the flash kernels by default
/// (`WICK_CUDA_FLASH_ROWS` overrides it). A flash block takes 64 (row, head) units, so 16
/// rows fill it for groups of four query heads (Llama 3, Qwen 2.5) and a quarter of it
/// without grouping, where its tensor cores still outrun the CUDA-core kernel; fewer rows
/// are decode steps and speculative drafts, which keep the exact f32 kernels (and
/// launches that repeat from step to step, so their graphs replay).
pub(super) const FLASH_ROWS: usize = 16;

/// Passes whose longest flash segment has at least this many new rows (prompt chunks, not
/// the small paced chunks beside decoding streams) take the wide kernels where one exists
/// ([`FlashKernel::wide`]): 128 units a block, so a tile of groups of four is 32 rows.
pub(super) const FLASH_WIDE_ROWS: usize = 128;

/// One flash kernel and its shape (the `FLASH_ENTRY` lines of `kernels.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FlashKernel {
    pub(super) kernel: Kernel,
    /// Head size the kernel is built for (`hd` ≤ it, padded with zeros).
    pub(super) hd: usize,
    /// Output dimensions a block makes (`hd`, or half of it for heads of 512: two blocks
    /// a tile).
    pub(super) hdv: usize,
    /// Keys a tile.
    pub(super) bn: usize,
    pub(super) warps: usize,
    /// 16-unit m-tiles a warp takes (2: each key and value fragment read from shared
    /// memory feeds two products).
    pub(super) mt: usize,
    /// Queries and probabilities as hi + lo pairs.
    pub(super) split: bool,
    /// Keys and values as hi + lo pairs (copied from an f32 cache).
    pub(super) kv_lo: bool,
}

impl FlashKernel {
    /// The kernel for `mode`, caches of f16 (`kv_half`) or f32, heads of `hd` dimensions:
    /// `None` when the mode is off or no kernel takes `hd` (a multiple of 8 up to 512).
    pub(super) fn select(mode: FlashAttention, kv_half: bool, hd: usize) -> Option<FlashKernel> {
        if hd == 0 || !hd.is_multiple_of(8) || hd > 512 {
            return None;
        }
        let size = match hd {
            0..=64 => 0,
            65..=128 => 1,
            129..=256 => 2,
            _ => 3,
        };
        let hd_max = [64, 128, 256, 512][size];
        let (kernel, bn, split, kv_lo) = match (mode, kv_half) {
            (FlashAttention::Off, _) => return None,
            (FlashAttention::Fast, _) => (
                [
                    Kernel::FlashFastD64,
                    Kernel::FlashFastD128,
                    Kernel::FlashFastD256,
                    Kernel::FlashFastD512,
                ][size],
                [64, 64, 32, 32][size],
                false,
                false,
            ),
            (FlashAttention::Exact, true) => (
                [
                    Kernel::FlashExactD64,
                    Kernel::FlashExactD128,
                    Kernel::FlashExactD256,
                    Kernel::FlashExactD512,
                ][size],
                [64, 64, 32, 16][size],
                true,
                false,
            ),
            (FlashAttention::Exact, false) => (
                [
                    Kernel::FlashExactLoD64,
                    Kernel::FlashExactLoD128,
                    Kernel::FlashExactLoD256,
                    Kernel::FlashExactLoD512,
                ][size],
                [64, 32, 16, 16][size],
                true,
                true,
            ),
        };
        // The exact kernel of f32 caches at 512 takes half the units to fit the shared
        // memory (`FLASH_ENTRY_V` lines of `kernels.cu`).
        let warps = if size == 3 && kv_lo { 2 } else { 4 };
        Some(FlashKernel {
            kernel,
            hd: hd_max,
            hdv: hd_max.min(256),
            bn,
            warps,
            mt: 1,
            split,
            kv_lo,
        })
    }

    /// The variant of this kernel whose warps take two m-tiles (`flash_fast_d{64,128}_m2`):
    /// f16 products at head sizes up to 128, where one m-tile a warp reads a key or value
    /// fragment from shared memory for every two tensor-core products and shared memory,
    /// not the tensor cores, sets the pace. `None` for the other kernels (their
    /// accumulators leave no registers for a second m-tile).
    pub(super) fn wide(&self) -> Option<FlashKernel> {
        let kernel = match self.kernel {
            Kernel::FlashFastD64 => Kernel::FlashFastD64M2,
            Kernel::FlashFastD128 => Kernel::FlashFastD128M2,
            _ => return None,
        };
        Some(FlashKernel {
            kernel,
            mt: 2,
            ..*self
        })
    }

    /// Blocks a tile takes (each making `hdv` of the output dimensions).
    pub(super) fn halves(&self) -> usize {
        self.hd / self.hdv
    }

    /// (row, head) units of a block.
    pub(super) fn units(&self) -> usize {
        16 * self.warps * self.mt
    }

    /// Dynamic shared memory of a block (`FLASH_SHARED` of `kernels.cu`): the queries (and
    /// their remainders), and two stages of key tiles and tiles of the block's value
    /// dimensions (and theirs), f16 rows padded by 8 values.
    pub(super) fn shared_bytes(&self) -> usize {
        let q = self.units() * if self.split { 2 } else { 1 } * (self.hd + 8);
        let kv = 2 * self.bn * if self.kv_lo { 2 } else { 1 } * (self.hd + self.hdv + 16);
        (q + kv) * 2
    }
}

/// Where a flash kernel reads a segment's f16 keys and values (`struct FlashSeg`).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct FlashSeg {
    k: u64,
    v: u64,
    k_lo: u64,
    v_lo: u64,
}

/// How the flash kernel's blocks are cut for a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FlashPlan {
    /// Row tiles, those that see the most keys first (they run longest, so they start
    /// first).
    pub(super) tiles: Vec<Tile>,
    /// Query heads of one KV head a block takes.
    pub(super) gc: usize,
    /// Blocks per KV head (`group / gc`, rounded up).
    pub(super) chunks: usize,
    /// Parts the keys of each tile are split into (merged by `attention_merge`).
    pub(super) parts: usize,
}

/// The first key a segment's first row sees (the start of its window).
pub(super) fn first_key(s: &Seg) -> usize {
    if s.window > 0 {
        (s.len_before - s.window + 1).max(0) as usize
    } else {
        0
    }
}

impl FlashPlan {
    /// For segments `flash` of `segs`, `group` query heads over `kv_heads` KV heads, blocks
    /// of `units` (row, head) units and key tiles of `bn`, on `sms` multiprocessors.
    pub(super) fn new(
        segs: &[Seg],
        flash: &[usize],
        group: usize,
        kv_heads: usize,
        units: usize,
        bn: usize,
        sms: usize,
    ) -> FlashPlan {
        let gc = group.clamp(1, units);
        let chunks = group.div_ceil(gc);
        let rows = (units / gc).max(1);
        let mut keyed = Vec::new();
        let mut most_keys = 0;
        for &i in flash {
            let s = &segs[i];
            let (start, n) = (s.row_start as usize, s.rows as usize);
            let before = s.len_before as usize;
            most_keys = most_keys.max(before + n - first_key(s));
            for r0 in (start..start + n).step_by(rows) {
                let tn = (start + n - r0).min(rows);
                keyed.push((before + r0 - start + tn, r0, tn));
            }
        }
        keyed.sort_by_key(|&(end, r0, _)| (std::cmp::Reverse(end), r0));
        let tiles: Vec<Tile> = keyed
            .into_iter()
            .map(|(_, r0, n)| Tile {
                row0: r0 as i32,
                n: n as i32,
            })
            .collect();
        // Two blocks fit an SM: split the keys when the tiles leave SMs idle, but give every
        // part at least four key tiles.
        let blocks = (tiles.len() * kv_heads * chunks).max(1);
        let parts = (2 * sms)
            .div_ceil(blocks)
            .min(most_keys / (4 * bn))
            .clamp(1, 32);
        FlashPlan {
            tiles,
            gc,
            chunks,
            parts,
        }
    }
}

/// Shapes of one attention call.
pub(super) struct Shape {
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) hd: usize,
    pub(super) scale: f32,
    pub(super) softcap: f32,
}

/// Device addresses of one attention call's staged inputs.
pub(super) struct Staged {
    pub(super) segs: u64,
    pub(super) seg_of_row: u64,
    pub(super) ends: u64,
}

impl CudaBackend {
    /// Records the flash attention of segments `flash` of `segs` (their keys and values
    /// already appended) into the rows of `out` they own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash_attend(
        &self,
        fk: FlashKernel,
        plan: &FlashPlan,
        segs: &[Seg],
        flash: &[usize],
        q: &CudaTensor,
        out: &CudaTensor,
        staged: &Staged,
        shape: &Shape,
    ) -> Result<()> {
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.hd);
        let row = kv_heads * hd;
        let mut fsegs = vec![FlashSeg::default(); segs.len()];
        // An f32 cache: the keys the chunk sees, copied to f16 (and remainders).
        let mut _copy: Option<Buffer> = None;
        if self.kv_half {
            for &i in flash {
                fsegs[i] = FlashSeg {
                    k: segs[i].k,
                    v: segs[i].v,
                    k_lo: 0,
                    v_lo: 0,
                };
            }
        } else {
            let span = |s: &Seg| (s.len_before + s.rows) as usize - first_key(s);
            let tokens: usize = flash.iter().map(|&i| span(&segs[i])).sum();
            let one = tokens * row * 2;
            let copies = if fk.kv_lo { 4 } else { 2 };
            let buf = self.dev.alloc(one * copies).map_err(cuda_err)?;
            let mut at = 0;
            for &i in flash {
                let s = &segs[i];
                // Token t of the segment at `at + t - first`: the copy starts at its first key.
                let k = (buf.ptr() + (at * row * 2) as u64)
                    .wrapping_sub((first_key(s) * row * 2) as u64);
                let lo = |n: u64| {
                    if fk.kv_lo {
                        k.wrapping_add(n * one as u64)
                    } else {
                        0
                    }
                };
                fsegs[i] = FlashSeg {
                    k,
                    v: k.wrapping_add(one as u64),
                    k_lo: lo(2),
                    v_lo: lo(3),
                };
                at += span(s);
            }
            let todo: Vec<i32> = flash.iter().map(|&i| i as i32).collect();
            let longest = flash.iter().map(|&i| span(&segs[i])).max().unwrap_or(0);
            let fsegs_dev = self.stage(&fsegs)?;
            let todo_dev = self.stage(&todo)?;
            self.launch(
                Kernel::KvFlashCopy,
                (longest.div_ceil(16) as u32, todo.len() as u32, 1),
                256,
                &[
                    Arg::Ptr(staged.segs),
                    Arg::Ptr(fsegs_dev),
                    Arg::Ptr(todo_dev),
                    Arg::I32(int(row, "KV row")?),
                    Arg::I32(i32::from(fk.kv_lo)),
                ],
            )?;
            _copy = Some(buf);
        }
        let fsegs_dev = self.stage(&fsegs)?;
        let tiles_dev = self.stage(&plan.tiles)?;
        let parts = plan.parts;
        let (ml, acc) = if parts > 1 {
            let slots = q.rows * heads * parts;
            (
                Some(self.dev.alloc(slots * 2 * 4).map_err(cuda_err)?),
                Some(self.dev.alloc(slots * hd * 4).map_err(cuda_err)?),
            )
        } else {
            (None, None)
        };
        let ptr = |b: &Option<Buffer>| b.as_ref().map_or(0, Buffer::ptr);
        self.dev
            .launch_shared(
                fk.kernel,
                (
                    (kv_heads * plan.chunks * fk.halves()) as u32,
                    plan.tiles.len() as u32,
                    parts as u32,
                ),
                (32 * fk.warps) as u32,
                fk.shared_bytes(),
                &[
                    Arg::Ptr(q.ptr()),
                    Arg::Ptr(out.ptr()),
                    Arg::Ptr(ptr(&ml)),
                    Arg::Ptr(ptr(&acc)),
                    Arg::Ptr(staged.segs),
                    Arg::Ptr(fsegs_dev),
                    Arg::Ptr(staged.seg_of_row),
                    Arg::Ptr(tiles_dev),
                    Arg::Ptr(staged.ends),
                    Arg::I32(heads as i32),
                    Arg::I32(kv_heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(plan.gc as i32),
                    Arg::F32(shape.scale),
                    Arg::F32(shape.softcap),
                ],
            )
            .map_err(cuda_err)?;
        if parts > 1 {
            let rows: Vec<i32> = flash
                .iter()
                .flat_map(|&i| {
                    let s = &segs[i];
                    s.row_start..s.row_start + s.rows
                })
                .collect();
            let rows_dev = self.stage(&rows)?;
            self.launch(
                Kernel::AttentionMerge,
                (rows.len() as u32, heads as u32, 1),
                hd.next_multiple_of(32) as u32,
                &[
                    Arg::Ptr(ptr(&ml)),
                    Arg::Ptr(ptr(&acc)),
                    Arg::Ptr(out.ptr()),
                    Arg::I32(heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(parts as i32),
                    Arg::Ptr(rows_dev),
                ],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(row_start: i32, rows: i32, len_before: i32, window: i32) -> Seg {
        Seg {
            k: 0,
            v: 0,
            len_before,
            row_start,
            rows,
            window,
        }
    }

    #[test]
    fn kernels_cover_head_sizes_up_to_512_in_multiples_of_8() {
        for mode in [FlashAttention::Fast, FlashAttention::Exact] {
            for half in [false, true] {
                for hd in (8..=512).step_by(8) {
                    let k = FlashKernel::select(mode, half, hd).unwrap();
                    let padded = match hd {
                        0..=64 => 64,
                        65..=128 => 128,
                        129..=256 => 256,
                        _ => 512,
                    };
                    assert_eq!(k.hd, padded, "head size {hd}");
                    assert_eq!(k.hdv * k.halves(), k.hd, "head size {hd}");
                    assert!(k.hdv <= 256, "head size {hd}: {k:?}");
                    assert_eq!(k.kv_lo, mode == FlashAttention::Exact && !half);
                    // Hopper's 227 KB a block; two blocks an SM for the fast kernels up
                    // to 256.
                    assert!(k.shared_bytes() <= 227 << 10, "{k:?}");
                    if mode == FlashAttention::Fast && hd <= 256 {
                        assert!(2 * k.shared_bytes() <= 228 << 10, "{k:?}");
                    }
                }
                for hd in [0, 12, 516, 520, 1024] {
                    assert_eq!(FlashKernel::select(mode, half, hd), None);
                }
            }
        }
        // Heads of 512: queries 64 × 520 f16, two stages of 32 keys × 520 and 32 values of
        // 256 dimensions × 264.
        let k = FlashKernel::select(FlashAttention::Fast, false, 512).unwrap();
        assert_eq!(k.halves(), 2);
        assert_eq!(k.shared_bytes(), (64 * 520 + 2 * 32 * (520 + 264)) * 2);
        assert_eq!(FlashKernel::select(FlashAttention::Off, true, 128), None);
        let k = FlashKernel::select(FlashAttention::Fast, false, 128).unwrap();
        // Queries 64 × 136 f16, two stages of 64-key K and V tiles.
        assert_eq!(k.shared_bytes(), (64 + 4 * 64) * 136 * 2);
        // Its wide variant: 128 queries, the same key tiles, two blocks an SM still.
        let w = k.wide().unwrap();
        assert_eq!(
            (w.kernel, w.units(), w.bn),
            (Kernel::FlashFastD128M2, 128, 64)
        );
        assert_eq!(w.shared_bytes(), (128 + 4 * 64) * 136 * 2);
        assert!(2 * w.shared_bytes() <= 228 << 10);
        let w = FlashKernel::select(FlashAttention::Fast, true, 64)
            .unwrap()
            .wide();
        assert_eq!(
            w.map(|w| (w.kernel, w.units())),
            Some((Kernel::FlashFastD64M2, 128))
        );
        // No wide variant of the exact kernels or of wider heads.
        for (mode, hd) in [(FlashAttention::Exact, 128), (FlashAttention::Fast, 256)] {
            assert_eq!(FlashKernel::select(mode, true, hd).unwrap().wide(), None);
        }
    }

    #[test]
    fn plans_cover_every_row_once_longest_first() {
        // A fresh 100-row prompt and a 40-row chunk after 1000 cached tokens, batched with
        // a decode row (not flash); groups of 4 (16 rows a tile) and of 7 (9 rows).
        let segs = [seg(0, 100, 0, 0), seg(100, 1, 37, 0), seg(101, 40, 1000, 0)];
        for (group, rows) in [(4, 16), (7, 9), (64, 1), (100, 1)] {
            let plan = FlashPlan::new(&segs, &[0, 2], group, 2, 64, 64, 132);
            assert_eq!(plan.gc, group.min(64));
            assert_eq!(plan.chunks, group.div_ceil(64));
            let mut seen = vec![0; 141];
            let mut last_end = usize::MAX;
            for t in &plan.tiles {
                assert!(t.n >= 1 && t.n as usize <= rows);
                for r in t.row0..t.row0 + t.n {
                    seen[r as usize] += 1;
                }
                let s = if t.row0 >= 101 { &segs[2] } else { &segs[0] };
                assert!(t.row0 + t.n <= s.row_start + s.rows);
                let end = (s.len_before + t.row0 - s.row_start + t.n) as usize;
                assert!(end <= last_end, "tiles not longest first");
                last_end = end;
            }
            for (r, &n) in seen.iter().enumerate() {
                assert_eq!(n, usize::from(r != 100), "row {r}");
            }
            assert!((1..=32).contains(&plan.parts));
        }
    }

    #[test]
    fn keys_are_split_only_when_the_tiles_leave_sms_idle() {
        // 16 rows against 16k cached keys: one tile a KV head, so the keys are split.
        let long = [seg(0, 16, 16_384, 0)];
        let plan = FlashPlan::new(&long, &[0], 4, 8, 64, 64, 132);
        assert_eq!(plan.tiles.len(), 1);
        assert_eq!(plan.parts, 32);
        // A 16k prompt in one pass: 1024 tiles × 8 KV heads, no split.
        let prompt = [seg(0, 16_384, 0, 0)];
        assert_eq!(FlashPlan::new(&prompt, &[0], 4, 8, 64, 64, 132).parts, 1);
        // Few keys: no part shorter than four key tiles.
        let short = [seg(0, 64, 0, 0)];
        assert_eq!(FlashPlan::new(&short, &[0], 4, 8, 64, 64, 132).parts, 1);
        // A window bounds the keys a chunk sees.
        let windowed = [seg(0, 16, 16_384, 512)];
        let plan = FlashPlan::new(&windowed, &[0], 4, 8, 64, 64, 132);
        // 527 keys: two parts of at least 256.
        assert_eq!(plan.parts, 2);
    }
}
