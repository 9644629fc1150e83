//! Prompt lookup: the tokens that followed the latest earlier occurrence of the
//! sequence's last `n` tokens, trying the longest `n` first.

/// Up to `k` tokens proposed to follow `history`: for `n` from `max` down to `min`, the
/// latest earlier place where `history`'s last `n` tokens occur, and what came after it
/// there. Empty when no suffix of at least `min` tokens recurs (or `k` is 0).
pub fn draft(history: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    if k == 0 || min == 0 {
        return Vec::new();
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        // Starts of earlier occurrences, latest first; the match must end before the
        // suffix itself so that at least one token follows it.
        for start in (0..len - n).rev() {
            if &history[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                return history[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        // "1 2 3 4 | 1 2 5 6 | 1 2" → the latest "1 2" was followed by 5 6 1 2.
        let h = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2];
        assert_eq!(draft(&h, 2, 4, 3), vec![5, 6, 1]);
        assert_eq!(draft(&h, 2, 4, 10), vec![5, 6, 1, 2]);
    }

    #[test]
    fn longer_suffixes_win() {
        // "7 1 2" occurred once, followed by 9; "1 2" alone occurs later followed by 8.
        let h = [7, 1, 2, 9, 1, 2, 8, 7, 1, 2];
        assert_eq!(draft(&h, 2, 3, 1), vec![9]);
        assert_eq!(draft(&h, 2, 2, 1), vec![8]);
    }

    #[test]
    fn nothing_without_a_match_of_min_tokens() {
        assert!(draft(&[1, 2, 3, 4], 2, 4, 3).is_empty());
        assert!(draft(&[1, 2, 3, 1], 2, 4, 3).is_empty());
        assert_eq!(draft(&[1, 2, 3, 1], 1, 4, 3), vec![2, 3, 1]);
        assert!(draft(&[], 1, 4, 3).is_empty());
        assert!(draft(&[5], 1, 4, 3).is_empty());
        assert!(draft(&[1, 2, 1, 2], 2, 4, 0).is_empty());
    }

    #[test]
    fn a_repeating_run_drafts_itself() {
        let h = [4, 4, 4, 4];
        assert_eq!(draft(&h, 2, 4, 3), vec![4]);
        let h = [1, 2, 1, 2, 1, 2];
        assert_eq!(draft(&h, 2, 4, 4), vec![1, 2]);
    }
}
