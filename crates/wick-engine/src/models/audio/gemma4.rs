//! Gemma 4's audio tower: the USM Conformer (an SSCP subsampler of two stride-2
//! convolutions, then layers of half-step feed-forward → chunked local attention with
//! relative positions and a logit cap → light depthwise causal convolution → half-step
//! feed-forward), its output projection, and `embed_audio` (a scale-free RMSNorm and a
//! linear map into the text model's width).
//!
//! It runs on the host in f32 with `gemm` products (the Backend op surface has no
//! convolutions or relative-position attention): a 30 s clip is 750 rows, small next to the
//! text model's prefill. Every frame it is given counts as real audio: the server hands it
//! only the frames that hold samples (the extractor's padded frames never reach a soft
//! token, and with causal convolutions and masked keys they change no real row).
use rayon::prelude::*;

use super::AudioConfig;
use crate::backend::Backend;
use crate::media::AudioFeatures;
use crate::models::decoder::loader::Loader;
use crate::models::deltanet::{mm, plain, transposed};
use crate::weights::RAW_PREFIX;
use crate::{EngineError, Result};

/// Rows one thread multiplies at a time.
const ROW_BLOCK: usize = 32;

/// A linear map `[out, in]` (row-major), with an optional bias and, for the clipped linears,
/// the `[input_min, input_max, output_min, output_max]` bounds stored with the weights.
struct Linear {
    w: Vec<f32>,
    out: usize,
    inp: usize,
    bias: Option<Vec<f32>>,
    clip: Option<[f32; 4]>,
}

impl Linear {
    /// `x` (`rows × inp`) times the map: `rows × out`.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.inp;
        let mut y = vec![0f32; rows * self.out];
        let clipped;
        let x = match self.clip {
            Some([lo, hi, _, _]) => {
                clipped = x.iter().map(|v| v.clamp(lo, hi)).collect::<Vec<_>>();
                &clipped[..]
            }
            None => x,
        };
        // Blocks of rows on the rayon pool (a 30 s clip is 750 rows through 4× wide
        // feed-forwards; one thread would take seconds on a full-size tower).
        y.par_chunks_mut(ROW_BLOCK * self.out)
            .zip(x.par_chunks(ROW_BLOCK * self.inp))
            .for_each(|(y, x)| {
                mm(
                    y,
                    plain(x),
                    transposed(&self.w),
                    (x.len() / self.inp, self.out, self.inp),
                    1.0,
                    false,
                )
            });
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        if let Some([_, _, lo, hi]) = self.clip {
            y.iter_mut().for_each(|v| *v = v.clamp(lo, hi));
        }
        y
    }
}

/// Half-step feed-forward: clamp, RMSNorm, `inp → 4·inp`, SiLU, back, clamp, RMSNorm, scaled
/// residual.
struct FeedForward {
    pre_norm: Vec<f32>,
    up: Linear,
    down: Linear,
    post_norm: Vec<f32>,
}

/// Chunked local self-attention with relative position logits.
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    post: Linear,
    /// `relative_k_proj` applied to the sinusoidal table: `[positions][hidden]`.
    rel_k: Vec<f32>,
    /// `softplus(per_dim_scale)` times the query scale, per head dimension.
    q_scale: Vec<f32>,
}

/// The light convolution block: RMSNorm, `h → 2h`, GLU, depthwise causal conv, clamp,
/// RMSNorm, SiLU, `h → h`, residual.
struct LightConv {
    pre_norm: Vec<f32>,
    start: Linear,
    /// `[channel][kernel]`.
    depthwise: Vec<f32>,
    conv_norm: Vec<f32>,
    end: Linear,
}

struct Layer {
    ff1: FeedForward,
    norm_pre_attn: Vec<f32>,
    attn: Attention,
    norm_post_attn: Vec<f32>,
    lconv: LightConv,
    ff2: FeedForward,
    norm_out: Vec<f32>,
}

/// One stride-2 3×3 convolution of the subsampler with its channel LayerNorm (no bias).
struct SubsampleConv {
    /// `[out][in · 3 · 3]`.
    w: Vec<f32>,
    inp: usize,
    out: usize,
    norm: Vec<f32>,
}

/// Gemma 4's audio Conformer and `embed_audio`, loaded.
pub(crate) struct Gemma4Audio {
    cfg: AudioConfig,
    text_hidden: usize,
    convs: [SubsampleConv; 2],
    input_proj: Linear,
    layers: Vec<Layer>,
    output_proj: Linear,
    embed: Linear,
}

fn name(s: &str) -> String {
    format!("{RAW_PREFIX}audio_tower.{s}")
}

impl Gemma4Audio {
    /// Whether `ld`'s weights hold the tower (a checkpoint may ship the text model only).
    pub(in crate::models) fn present<B: Backend>(ld: &Loader<'_, B>) -> bool {
        ld.src.contains(&name("output_proj.weight"))
            && ld.src.contains(&format!(
                "{RAW_PREFIX}embed_audio.embedding_projection.weight"
            ))
    }

    pub(in crate::models) fn load<B: Backend>(
        ld: &mut Loader<'_, B>,
        cfg: &AudioConfig,
        text_hidden: usize,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let mut bytes = 0usize;
        let mut values = |ld: &Loader<'_, B>, full: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let w = ld.required(full)?;
            ld.check(&w, shape)?;
            let v = w.float_values(full)?;
            bytes += v.len() * 4;
            Ok(v)
        };
        let mut linear = |ld: &Loader<'_, B>,
                          n: &str,
                          out: usize,
                          inp: usize,
                          clipped: bool,
                          bias: bool|
         -> Result<Linear> {
            let (wname, clip) = if clipped && cfg.clipped_linears {
                let mut b = [0f32; 4];
                for (slot, key) in
                    b.iter_mut()
                        .zip(["input_min", "input_max", "output_min", "output_max"])
                {
                    *slot = values(ld, &name(&format!("{n}.{key}")), &[])?
                        .first()
                        .copied()
                        .unwrap_or(0.0);
                }
                (format!("{n}.linear.weight"), Some(b))
            } else if clipped {
                (format!("{n}.linear.weight"), None)
            } else {
                (format!("{n}.weight"), None)
            };
            let w = values(ld, &name(&wname), &[out, inp])?;
            let bias = if bias {
                Some(values(ld, &name(&format!("{n}.bias")), &[out])?)
            } else {
                None
            };
            Ok(Linear {
                w,
                out,
                inp,
                bias,
                clip,
            })
        };
        let vector = |ld: &Loader<'_, B>, n: &str, len: usize| -> Result<Vec<f32>> {
            let w = ld.required(&name(n))?;
            ld.check(&w, &[len])?;
            w.float_values(n)
        };
        let [c0, c1] = cfg.conv_channels;
        let conv =
            |ld: &Loader<'_, B>, i: usize, inp: usize, out: usize| -> Result<SubsampleConv> {
                let n = format!("subsample_conv_projection.layer{i}");
                let w = ld.required(&name(&format!("{n}.conv.weight")))?;
                ld.check(&w, &[out, inp, 3, 3])?;
                Ok(SubsampleConv {
                    w: w.float_values("subsampler convolution")?,
                    inp,
                    out,
                    norm: vector(ld, &format!("{n}.norm.weight"), out)?,
                })
            };
        let convs = [conv(ld, 0, 1, c0)?, conv(ld, 1, c0, c1)?];
        let freq = super::MEL_BINS.div_ceil(2).div_ceil(2);
        let input_proj = linear(
            ld,
            "subsample_conv_projection.input_proj_linear",
            h,
            freq * c1,
            false,
            false,
        )?;
        let hd = h / cfg.num_heads;
        let table = relative_positions(cfg);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            let mut ff = |ld: &Loader<'_, B>, which: &str| -> Result<FeedForward> {
                Ok(FeedForward {
                    pre_norm: vector(ld, &n(&format!("{which}.pre_layer_norm.weight")), h)?,
                    up: linear(
                        ld,
                        &n(&format!("{which}.ffw_layer_1")),
                        4 * h,
                        h,
                        true,
                        false,
                    )?,
                    down: linear(
                        ld,
                        &n(&format!("{which}.ffw_layer_2")),
                        h,
                        4 * h,
                        true,
                        false,
                    )?,
                    post_norm: vector(ld, &n(&format!("{which}.post_layer_norm.weight")), h)?,
                })
            };
            let ff1 = ff(ld, "feed_forward1")?;
            let ff2 = ff(ld, "feed_forward2")?;
            let rel = linear(ld, &n("self_attn.relative_k_proj"), h, h, false, false)?;
            let per_dim = vector(ld, &n("self_attn.per_dim_scale"), hd)?;
            let base = (hd as f32).powf(-0.5) / std::f32::consts::LN_2;
            let attn = Attention {
                q: linear(ld, &n("self_attn.q_proj"), h, h, true, false)?,
                k: linear(ld, &n("self_attn.k_proj"), h, h, true, false)?,
                v: linear(ld, &n("self_attn.v_proj"), h, h, true, false)?,
                post: linear(ld, &n("self_attn.post"), h, h, true, false)?,
                rel_k: rel.apply(&table),
                q_scale: per_dim.iter().map(|&s| base * softplus(s)).collect(),
            };
            let dw = ld.required(&name(&n("lconv1d.depthwise_conv1d.weight")))?;
            ld.check(&dw, &[h, 1, cfg.conv_kernel])?;
            let lconv = LightConv {
                pre_norm: vector(ld, &n("lconv1d.pre_layer_norm.weight"), h)?,
                start: linear(ld, &n("lconv1d.linear_start"), 2 * h, h, true, false)?,
                depthwise: dw.float_values("depthwise convolution")?,
                conv_norm: vector(ld, &n("lconv1d.conv_norm.weight"), h)?,
                end: linear(ld, &n("lconv1d.linear_end"), h, h, true, false)?,
            };
            layers.push(Layer {
                ff1,
                norm_pre_attn: vector(ld, &n("norm_pre_attn.weight"), h)?,
                attn,
                norm_post_attn: vector(ld, &n("norm_post_attn.weight"), h)?,
                lconv,
                ff2,
                norm_out: vector(ld, &n("norm_out.weight"), h)?,
            });
        }
        let output_proj = linear(ld, "output_proj", cfg.output_dims, h, false, true)?;
        let embed_name = format!("{RAW_PREFIX}embed_audio.embedding_projection.weight");
        let ew = ld.required(&embed_name)?;
        ld.check(&ew, &[text_hidden, cfg.output_dims])?;
        let embed = Linear {
            w: ew.float_values("embed_audio")?,
            out: text_hidden,
            inp: cfg.output_dims,
            bias: None,
            clip: None,
        };
        ld.bytes += bytes + (text_hidden * cfg.output_dims) * 4;
        Ok(Gemma4Audio {
            cfg: cfg.clone(),
            text_hidden,
            convs,
            input_proj,
            layers,
            output_proj,
            embed,
        })
    }

    /// The clip's soft-token rows in the text model's embedding space,
    /// `[soft_tokens(frames)][text_hidden]` row-major.
    pub(crate) fn embed(&self, clip: &AudioFeatures) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        if clip.bins != super::MEL_BINS
            || clip.frames == 0
            || clip.data.len() != clip.frames * clip.bins
        {
            return Err(EngineError::InvalidInput(format!(
                "the audio tower reads frames of {} mel bins; the clip has {} frames of {} bins ({} values)",
                super::MEL_BINS,
                clip.frames,
                clip.bins,
                clip.data.len()
            )));
        }
        if super::soft_tokens(clip.frames) > super::MAX_TOKENS {
            return Err(EngineError::InvalidInput(format!(
                "the audio clip has {} frames, more than the {} soft tokens (30 s) the tower reads",
                clip.frames,
                super::MAX_TOKENS
            )));
        }
        // Channels-last `[time][freq][channel]` through the subsampler.
        let (mut x, mut t, mut f) = (clip.data.to_vec(), clip.frames, clip.bins);
        for conv in &self.convs {
            (x, t, f) = conv.apply(&x, t, f, cfg.eps);
        }
        let mut x = self.input_proj.apply(&x);
        let h = cfg.hidden_size;
        let clamp = cfg.gradient_clipping.min(f32::MAX);
        for l in &self.layers {
            l.ff1.apply(&mut x, h, cfg, clamp);
            let residual = x.clone();
            clamp_all(&mut x, clamp);
            rms_norm(&mut x, h, Some(&l.norm_pre_attn), cfg.eps);
            let mut a = l.attn.apply(&x, t, cfg);
            clamp_all(&mut a, clamp);
            rms_norm(&mut a, h, Some(&l.norm_post_attn), cfg.eps);
            x = a;
            x.iter_mut().zip(&residual).for_each(|(v, r)| *v += r);
            l.lconv.apply(&mut x, h, cfg, clamp);
            l.ff2.apply(&mut x, h, cfg, clamp);
            clamp_all(&mut x, clamp);
            rms_norm(&mut x, h, Some(&l.norm_out), cfg.eps);
        }
        let mut out = self.output_proj.apply(&x);
        rms_norm(&mut out, cfg.output_dims, None, cfg.eps);
        let rows = self.embed.apply(&out);
        debug_assert_eq!(rows.len(), t * self.text_hidden);
        Ok(rows)
    }
}

impl SubsampleConv {
    /// The convolution (stride 2, padding 1, no bias), LayerNorm over channels, ReLU:
    /// `[t][f][inp]` → `[ceil(t/2)][ceil(f/2)][out]`.
    fn apply(&self, x: &[f32], t: usize, f: usize, eps: f32) -> (Vec<f32>, usize, usize) {
        let (t2, f2) = (t.div_ceil(2), f.div_ceil(2));
        let k = self.inp * 9;
        // im2col: one row per output cell, columns in the kernel's `[in][ky][kx]` order.
        let mut cols = vec![0f32; t2 * f2 * k];
        for ot in 0..t2 {
            for of in 0..f2 {
                let row = &mut cols[(ot * f2 + of) * k..(ot * f2 + of + 1) * k];
                for ky in 0..3 {
                    let it = (2 * ot + ky).wrapping_sub(1);
                    if it >= t {
                        continue;
                    }
                    for kx in 0..3 {
                        let jf = (2 * of + kx).wrapping_sub(1);
                        if jf >= f {
                            continue;
                        }
                        let src = &x[(it * f + jf) * self.inp..(it * f + jf + 1) * self.inp];
                        for (c, v) in src.iter().enumerate() {
                            row[c * 9 + ky * 3 + kx] = *v;
                        }
                    }
                }
            }
        }
        let mut y = vec![0f32; t2 * f2 * self.out];
        mm(
            &mut y,
            plain(&cols),
            transposed(&self.w),
            (t2 * f2, self.out, k),
            1.0,
            false,
        );
        for cell in y.chunks_exact_mut(self.out) {
            let n = self.out as f32;
            let mean = cell.iter().sum::<f32>() / n;
            let var = cell.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            for (v, w) in cell.iter_mut().zip(&self.norm) {
                *v = ((*v - mean) * inv * w).max(0.0);
            }
        }
        (y, t2, f2)
    }
}

impl FeedForward {
    fn apply(&self, x: &mut [f32], h: usize, cfg: &AudioConfig, clamp: f32) {
        let mut y = x.to_vec();
        clamp_all(&mut y, clamp);
        rms_norm(&mut y, h, Some(&self.pre_norm), cfg.eps);
        let mut u = self.up.apply(&y);
        u.iter_mut().for_each(|v| *v = silu(*v));
        let mut y = self.down.apply(&u);
        clamp_all(&mut y, clamp);
        rms_norm(&mut y, h, Some(&self.post_norm), cfg.eps);
        x.iter_mut()
            .zip(&y)
            .for_each(|(v, y)| *v += y * cfg.residual_weight);
    }
}

impl LightConv {
    fn apply(&self, x: &mut [f32], h: usize, cfg: &AudioConfig, clamp: f32) {
        let t = x.len() / h;
        let mut y = x.to_vec();
        rms_norm(&mut y, h, Some(&self.pre_norm), cfg.eps);
        let s = self.start.apply(&y);
        // GLU: the first half gated by the sigmoid of the second.
        let g: Vec<f32> = s
            .chunks_exact(2 * h)
            .flat_map(|r| {
                r[..h]
                    .iter()
                    .zip(&r[h..])
                    .map(|(a, b)| a * sigmoid(*b))
                    .collect::<Vec<_>>()
            })
            .collect();
        let k = cfg.conv_kernel;
        let mut c = vec![0f32; t * h];
        for i in 0..t {
            for (j, w) in (0..k).rev().enumerate() {
                // Tap `w` of the kernel reads `k − 1 − w` frames back.
                let Some(src) = i.checked_sub(j) else { break };
                let row = &g[src * h..(src + 1) * h];
                let out = &mut c[i * h..(i + 1) * h];
                for ch in 0..h {
                    out[ch] += self.depthwise[ch * k + w] * row[ch];
                }
            }
        }
        clamp_all(&mut c, clamp);
        rms_norm(&mut c, h, Some(&self.conv_norm), cfg.eps);
        c.iter_mut().for_each(|v| *v = silu(*v));
        let e = self.end.apply(&c);
        x.iter_mut().zip(&e).for_each(|(v, e)| *v += e);
    }
}

impl Attention {
    /// `x` is `t × hidden`; queries go in chunks of `chunk`, each seeing its chunk's
    /// context window of keys.
    fn apply(&self, x: &[f32], t: usize, cfg: &AudioConfig) -> Vec<f32> {
        let h = cfg.hidden_size;
        let heads = cfg.num_heads;
        let hd = h / heads;
        let chunk = cfg.chunk;
        let past = cfg.context_left - 1;
        let context = cfg.context_size();
        let positions = context / 2 + 1;
        let mut q = self.q.apply(x);
        let mut k = self.k.apply(x);
        let v = self.v.apply(x);
        let k_scale = (1.0 + std::f32::consts::E).ln() / std::f32::consts::LN_2;
        for row in q.chunks_exact_mut(hd) {
            row.iter_mut().zip(&self.q_scale).for_each(|(v, s)| *v *= s);
        }
        k.iter_mut().for_each(|v| *v *= k_scale);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
        // The query row of frame `i`, head `hh` (zero past the clip, as the padded chunk).
        let query =
            |i: usize, hh: usize| (i < t).then(|| &q[i * h + hh * hd..i * h + (hh + 1) * hd]);
        // Relative logit of query `i` (head `hh`) against table row `p`.
        let rel = |i: usize, hh: usize, p: usize| -> f32 {
            match query(i, hh) {
                Some(qr) if p < positions => {
                    dot(qr, &self.rel_k[p * h + hh * hd..p * h + (hh + 1) * hd])
                }
                _ => 0.0,
            }
        };
        let mut out = vec![0f32; t * h];
        let mut logits = vec![0f32; context];
        for i in 0..t {
            let (block, qi) = (i / chunk, i % chunk);
            for hh in 0..heads {
                let qr = &q[i * h + hh * hd..i * h + (hh + 1) * hd];
                for (c, l) in logits.iter_mut().enumerate() {
                    // Key frame of context slot `c` (before the clip when negative).
                    let j = (block * chunk + c) as isize - past as isize;
                    let ac = if j >= 0 && (j as usize) < t {
                        let j = j as usize;
                        dot(qr, &k[j * h + hh * hd..j * h + (hh + 1) * hd])
                    } else {
                        0.0
                    };
                    // transformers' relative shift of the `[chunk][positions]` products:
                    // slot `c` of row `qi` reads row `qi`, column `c − qi`, or for `c < qi`
                    // the previous row's column `context + 1 + c − qi`.
                    let bd = if c >= qi {
                        rel(i, hh, c - qi)
                    } else {
                        rel(i - 1, hh, context + 1 + c - qi)
                    };
                    let capped = ((ac + bd) / cfg.logit_cap).tanh() * cfg.logit_cap;
                    let dist = i as isize - j;
                    let seen = j >= 0
                        && (j as usize) < t
                        && ((0..past as isize).contains(&dist)
                            || (dist < 0 && -dist < cfg.context_right as isize));
                    *l = if seen { capped } else { cfg.invalid_logit };
                }
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                logits.iter_mut().for_each(|l| {
                    *l = (*l - max).exp();
                    sum += *l;
                });
                let o = &mut out[i * h + hh * hd..i * h + (hh + 1) * hd];
                for (c, w) in logits.iter().enumerate() {
                    let j = (block * chunk + c) as isize - past as isize;
                    if j < 0 || j as usize >= t {
                        continue;
                    }
                    let j = j as usize;
                    let vr = &v[j * h + hh * hd..j * h + (hh + 1) * hd];
                    let w = w / sum;
                    o.iter_mut().zip(vr).for_each(|(o, v)| *o += w * v);
                }
            }
        }
        self.post.apply(&out)
    }
}

/// The sinusoidal table of relative positions `context/2, …, 1, 0`: `[sin…, cos…]` rows
/// of `hidden` values, as transformers computes it in f32.
fn relative_positions(cfg: &AudioConfig) -> Vec<f32> {
    let h = cfg.hidden_size;
    let half = h / 2;
    let top = cfg.context_size() / 2;
    let step = (10_000f64.ln() / (half.saturating_sub(1).max(1)) as f64) as f32;
    let inv: Vec<f32> = (0..half).map(|i| (i as f32 * -step).exp()).collect();
    let mut table = vec![0f32; (top + 1) * h];
    for (p, row) in table.chunks_exact_mut(h).enumerate() {
        let pos = (top - p) as f32;
        for (i, &s) in inv.iter().enumerate() {
            row[i] = (pos * s).sin();
            row[half + i] = (pos * s).cos();
        }
    }
    table
}

/// `x · (mean(x²) + eps)^-½`, times `scale` when given, per `width`-wide row.
fn rms_norm(x: &mut [f32], width: usize, scale: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = (ms + eps).powf(-0.5);
        match scale {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, w)| *v *= inv * w),
            None => row.iter_mut().for_each(|v| *v *= inv),
        }
    }
}

fn clamp_all(x: &mut [f32], bound: f32) {
    x.iter_mut().for_each(|v| *v = v.clamp(-bound, bound));
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + eˣ)`, linear above 20 as torch's.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
