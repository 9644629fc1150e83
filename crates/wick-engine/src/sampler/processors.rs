//! Logits processors, applied before sampling in mlx-lm's order: `logit_bias` →
//! repetition penalty → presence penalty → frequency penalty.
//!
//! Each works on the raw logits row and the token history (prompt and generated tokens so
//! far, as mlx-lm passes them). Token ids outside the row are skipped, never a panic.

/// The tail of `history` a penalty looks at: the last `window` tokens, or all for 0.
fn window(history: &[u32], window: usize) -> &[u32] {
    if window == 0 || window >= history.len() {
        history
    } else {
        &history[history.len() - window..]
    }
}

/// Marks tokens as seen for one pass, to visit each distinct token once in O(window).
///
/// One stamp per vocabulary entry; a pass bumps the current stamp instead of clearing.
#[derive(Debug, Default, Clone)]
pub(crate) struct TokenMarks {
    stamps: Vec<u32>,
    current: u32,
}

impl TokenMarks {
    /// Starts a pass over a row of `vocab` entries.
    fn begin(&mut self, vocab: usize) {
        if self.stamps.len() < vocab {
            self.stamps.resize(vocab, 0);
        }
        self.current = self.current.wrapping_add(1);
        if self.current == 0 {
            self.stamps.fill(0);
            self.current = 1;
        }
    }

    /// Marks `id` and says whether this pass saw it for the first time.
    fn first_visit(&mut self, id: usize) -> bool {
        let fresh = self.stamps[id] != self.current;
        self.stamps[id] = self.current;
        fresh
    }

    /// Calls `visit` once for each distinct in-range token of `tokens`.
    fn for_each_distinct(&mut self, tokens: &[u32], vocab: usize, mut visit: impl FnMut(usize)) {
        self.begin(vocab);
        for &token in tokens {
            let id = token as usize;
            if id < vocab && self.first_visit(id) {
                visit(id);
            }
        }
    }
}

/// Adds each bias to its token's logit.
pub(crate) fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(token, value) in bias {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit += value;
        }
    }
}

/// mlx-lm's repetition penalty: for each distinct token of the window, a negative logit is
/// multiplied by `penalty` and any other divided by it. Off for 0 and 1.
pub(crate) fn apply_repetition_penalty(
    logits: &mut [f32],
    history: &[u32],
    penalty: f32,
    context: usize,
    marks: &mut TokenMarks,
) {
    if penalty == 0.0 || penalty == 1.0 {
        return;
    }
    let vocab = logits.len();
    marks.for_each_distinct(window(history, context), vocab, |id| {
        let x = logits[id];
        logits[id] = if x < 0.0 { x * penalty } else { x / penalty };
    });
}

/// Presence penalty: `penalty` subtracted once for each distinct token of the window.
pub(crate) fn apply_presence_penalty(
    logits: &mut [f32],
    history: &[u32],
    penalty: f32,
    context: usize,
    marks: &mut TokenMarks,
) {
    if penalty == 0.0 {
        return;
    }
    let vocab = logits.len();
    marks.for_each_distinct(window(history, context), vocab, |id| logits[id] -= penalty);
}

/// Frequency penalty: `penalty` subtracted once per occurrence in the window.
pub(crate) fn apply_frequency_penalty(
    logits: &mut [f32],
    history: &[u32],
    penalty: f32,
    context: usize,
) {
    if penalty == 0.0 {
        return;
    }
    for &token in window(history, context) {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit -= penalty;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn logit_bias_adds_and_skips_unknown_ids() {
        let mut row = [0.0, 1.0, 2.0];
        apply_logit_bias(&mut row, &[(0, 0.5), (2, -3.0), (9, 1.0), (0, 0.25)]);
        assert_eq!(row, [0.75, 1.0, -1.0]);
    }

    #[test]
    fn repetition_penalty_by_hand() {
        // Window of 3 over [4, 0, 1, 1, 3]: tokens {1, 3}; 0 and 4 are outside.
        let mut row = [2.0, 3.0, -1.0, -2.0, 5.0];
        let mut marks = TokenMarks::default();
        apply_repetition_penalty(&mut row, &[4, 0, 1, 1, 3], 2.0, 3, &mut marks);
        assert!(close(&row, &[2.0, 1.5, -1.0, -4.0, 5.0]), "{row:?}");
        // Window 0 = the whole history; a repeated token is still penalized once.
        let mut row = [2.0, 3.0, -1.0, -2.0, 5.0];
        apply_repetition_penalty(&mut row, &[4, 0, 1, 1, 3, 77], 2.0, 0, &mut marks);
        assert!(close(&row, &[1.0, 1.5, -1.0, -4.0, 2.5]), "{row:?}");
        // 1 and 0 are off.
        let mut row = [2.0, -3.0];
        apply_repetition_penalty(&mut row, &[0, 1], 1.0, 0, &mut marks);
        apply_repetition_penalty(&mut row, &[0, 1], 0.0, 0, &mut marks);
        assert_eq!(row, [2.0, -3.0]);
    }

    #[test]
    fn presence_counts_distinct_tokens_and_frequency_counts_occurrences() {
        let history = [1, 2, 2, 2, 0, 1];
        let mut marks = TokenMarks::default();
        let mut row = [0.0; 4];
        apply_presence_penalty(&mut row, &history, 0.5, 0, &mut marks);
        assert!(close(&row, &[-0.5, -0.5, -0.5, 0.0]), "{row:?}");
        let mut row = [0.0; 4];
        apply_frequency_penalty(&mut row, &history, 0.5, 0);
        assert!(close(&row, &[-0.5, -1.0, -1.5, 0.0]), "{row:?}");
        // Windows of 2: the last two tokens [0, 1].
        let mut row = [0.0; 4];
        apply_presence_penalty(&mut row, &history, 1.0, 2, &mut marks);
        apply_frequency_penalty(&mut row, &history, 1.0, 2);
        assert!(close(&row, &[-2.0, -2.0, 0.0, 0.0]), "{row:?}");
        // Negative penalties reward.
        let mut row = [0.0; 4];
        apply_frequency_penalty(&mut row, &history, -1.0, 0);
        assert!(close(&row, &[1.0, 2.0, 3.0, 0.0]), "{row:?}");
    }

    #[test]
    fn marks_survive_many_passes() {
        let mut marks = TokenMarks {
            stamps: vec![u32::MAX - 1; 3],
            current: u32::MAX - 1,
        };
        for _ in 0..4 {
            let mut seen = Vec::new();
            marks.for_each_distinct(&[2, 0, 2, 0, 5], 3, |id| seen.push(id));
            assert_eq!(seen, vec![2, 0]);
        }
    }
}
