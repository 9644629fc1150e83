//! Multimodal rotary positions (M-RoPE, Qwen-VL): every prompt position is a
//! `(temporal, row, column)` triple. Text tokens have three equal components; an image's soft
//! tokens, laid out on its merged patch grid, get `(s, s + row, s + column)` where `s` is
//! the position the image starts at; the text after an image resumes at `s + max(rows,
//! columns)`. Each rotary frequency turns with one of the three components.
//!
//! The triples follow from the sequence's images alone ([`ImageRows::grid`]), so a
//! recomputed or resumed sequence (preemption, a prompt-cache hit) gets the same positions,
//! and decoding continues at `index + delta` where `delta` is what the images shifted.
use serde_json::Value;

use crate::config::mrope::Mrope;
use crate::config::HfKeys;
use crate::models::vision::ImageRows;
use crate::{EngineError, Result};

impl Mrope {
    /// Reads `mrope_section` (frequencies per component) and `mrope_interleaved` from the
    /// text config's `rope_parameters` (or `rope_scaling`); `None` without a section.
    /// Interleaved (Qwen 3.5): frequencies cycle temporal, row, column, and those past a
    /// component's share stay temporal. Otherwise (Qwen2-VL, Qwen2.5-VL) each component
    /// takes a contiguous block.
    pub(crate) fn from_hf(keys: &HfKeys<'_>, rotary_dims: usize) -> Result<Option<Self>> {
        let params = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| keys.get(k).filter(|v| v.get("mrope_section").is_some()));
        let Some(params) = params else {
            return Ok(None);
        };
        let bad = |reason: String| EngineError::Config {
            source_name: keys.source.to_string(),
            reason,
        };
        let section: Vec<usize> = params["mrope_section"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default();
        let half = rotary_dims / 2;
        if section.len() != 3 || section.iter().sum::<usize>() != half {
            return Err(bad(format!(
                "mrope_section {:?} must be three counts summing to the {half} rotary frequencies",
                params["mrope_section"]
            )));
        }
        let interleaved = params
            .get("mrope_interleaved")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Some(Mrope::new(&section, interleaved)))
    }

    fn new(section: &[usize], interleaved: bool) -> Self {
        let half: usize = section.iter().sum();
        let axes = if interleaved {
            (0..half)
                .map(|i| match i % 3 {
                    1 if i < 3 * section[1] => 1,
                    2 if i < 3 * section[2] => 2,
                    _ => 0,
                })
                .collect()
        } else {
            section
                .iter()
                .enumerate()
                .flat_map(|(axis, &n)| std::iter::repeat_n(axis as u8, n))
                .collect()
        };
        Mrope { axes }
    }
}

/// The position triples of positions `range` of a sequence whose images are `images`
/// (in prompt order, each with its merged grid).
pub fn positions(images: &[ImageRows], range: std::ops::Range<usize>) -> Vec<[usize; 3]> {
    let mut out = Vec::with_capacity(range.len());
    for i in range {
        // The shift of every image that ends at or before `i`, and the image holding `i`.
        let mut delta = 0isize;
        let mut inside = None;
        for img in images {
            let Some((rows, cols)) = img.grid else {
                continue;
            };
            let p = &img.positions;
            if p.end <= i {
                delta += rows.max(cols) as isize - p.len() as isize;
            } else if p.start <= i {
                inside = Some((p.start, cols, i - p.start));
                break;
            } else {
                break;
            }
        }
        let at = |x: usize| (x as isize + delta).max(0) as usize;
        out.push(match inside {
            Some((start, cols, k)) => {
                let s = at(start);
                [s, s + k / cols, s + k % cols]
            }
            None => [at(i); 3],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(positions: std::ops::Range<usize>, grid: (usize, usize)) -> ImageRows {
        ImageRows {
            rows: vec![0.0; positions.len()].into(),
            positions,
            bidirectional: false,
            grid: Some(grid),
        }
    }

    #[test]
    fn interleaved_axes_cycle_within_each_share() {
        assert_eq!(Mrope::new(&[2, 1, 1], true).axes, vec![0, 1, 2, 0]);
        // Qwen 3.5's sections: rows take 1, 4, …, 31 and columns 2, 5, …, 29.
        assert_eq!(Mrope::new(&[11, 11, 10], true).axes[27..], [0, 1, 2, 0, 1]);
        assert_eq!(Mrope::new(&[2, 1, 1], false).axes, vec![0, 0, 1, 2]);
    }

    #[test]
    fn text_after_an_image_resumes_past_its_largest_side() {
        // Two text tokens, a 2×3 image, two text tokens.
        let imgs = [image(2..8, (2, 3))];
        let p = positions(&imgs, 0..10);
        assert_eq!(p[1], [1, 1, 1]);
        assert_eq!(p[2], [2, 2, 2]);
        assert_eq!(p[4], [2, 2, 4]);
        assert_eq!(p[5], [2, 3, 2]);
        assert_eq!(p[7], [2, 3, 4]);
        // Resumes at 2 + max(2, 3) = 5.
        assert_eq!(p[8], [5, 5, 5]);
        assert_eq!(p[9], [6, 6, 6]);
        // A later range (a decode step) sees the same shift.
        assert_eq!(positions(&imgs, 12..13), vec![[9, 9, 9]]);
        assert_eq!(positions(&[], 3..4), vec![[3, 3, 3]]);
    }
}
