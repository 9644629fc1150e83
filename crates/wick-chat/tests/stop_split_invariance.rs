//! Stop matching gives the same output for every way of cutting the text into pieces.
//!
//! The reference is the whole-text rule: the stop string that starts first wins (the
//! shortest one on a tie) and everything from its start on is dropped. For every split of
//! each sample text into pieces (at char boundaries, so multi-byte characters stay whole)
//! the streamed output must equal the reference, and at no moment may the text emitted so
//! far run past the reference output (so no part of a stop string is ever shown).
use wick_chat::stop::StopMatcher;

/// Whole-text reference: (text kept, stop that matched).
fn reference(text: &str, stops: &[&str]) -> (String, Option<String>) {
    let found = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s).map(|at| (at, s.len(), s.to_string())))
        .min();
    match found {
        Some((at, _, stop)) => (text[..at].to_string(), Some(stop)),
        None => (text.to_string(), None),
    }
}

/// Streams `pieces` through a matcher the way the generation loop does: stop feeding at the
/// first match, flush otherwise. Checks the prefix property on the way.
fn stream(pieces: &[&str], stops: &[&str], expected: &str) -> (String, Option<String>) {
    let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()));
    let mut out = String::new();
    for piece in pieces {
        let step = matcher.push(piece);
        out.push_str(&step.emit);
        assert!(
            expected.starts_with(&out),
            "emitted {out:?} runs past {expected:?} (pieces {pieces:?}, stops {stops:?})"
        );
        if let Some(found) = step.stopped {
            return (out, Some(found.stop));
        }
    }
    out.push_str(&matcher.flush());
    (out, matcher.stop_match().map(|m| m.stop.clone()))
}

/// Calls `check` with every split of `text` into consecutive non-empty pieces.
fn for_every_split(text: &str, mut check: impl FnMut(&[&str])) {
    let cuts: Vec<usize> = text.char_indices().map(|(at, _)| at).skip(1).collect();
    assert!(
        cuts.len() <= 16,
        "text too long for an exhaustive split test"
    );
    for mask in 0u32..(1 << cuts.len()) {
        let mut pieces = Vec::new();
        let mut from = 0;
        for (bit, &cut) in cuts.iter().enumerate() {
            if mask & (1 << bit) != 0 {
                pieces.push(&text[from..cut]);
                from = cut;
            }
        }
        pieces.push(&text[from..]);
        check(&pieces);
    }
}

fn assert_split_invariant(text: &str, stops: &[&str]) {
    let expected = reference(text, stops);
    let mut splits = 0;
    for_every_split(text, |pieces| {
        splits += 1;
        let got = stream(pieces, stops, &expected.0);
        assert_eq!(
            got, expected,
            "text {text:?}, stops {stops:?}, pieces {pieces:?}"
        );
    });
    assert!(splits >= 1);
}

#[test]
fn plain_stop_in_the_middle() {
    assert_split_invariant("hello</s>world", &["</s>"]);
    assert_split_invariant("hello </", &["</s>"]);
    assert_split_invariant("a</s</s>", &["</s>"]);
}

#[test]
fn stop_at_the_start() {
    assert_split_invariant("Hi there", &["Hi"]);
    assert_split_invariant("User:", &["User:", "Assistant:"]);
}

#[test]
fn overlapping_stops() {
    assert_split_invariant("xaaab_end", &["aab", "ab"]);
    assert_split_invariant("abaabab!", &["abab"]);
    assert_split_invariant("ababab", &["bab", "aba"]);
    assert_split_invariant("aaaaaaaaab", &["aaab"]);
    assert_split_invariant("xyxyxyz", &["xyxyz", "yxyz"]);
}

#[test]
fn a_stop_that_is_a_prefix_of_another() {
    for stops in [["ab", "abc"], ["abc", "ab"]] {
        assert_split_invariant("zabc", &stops);
        assert_split_invariant("zabz", &stops);
        assert_split_invariant("za", &stops);
    }
    assert_split_invariant("<|im_end|>", &["<|im", "<|im_end|>", "<|"]);
}

#[test]
fn a_stop_inside_a_longer_one() {
    for text in ["abcd", "abcx", "abc", "zabcbcd", "ab"] {
        assert_split_invariant(text, &["abcd", "bc"]);
    }
    assert_split_invariant("--abcde", &["abcdef", "cd", "bcx"]);
}

#[test]
fn multi_byte_characters() {
    assert_split_invariant("café!日本語", &["é!", "日本"]);
    assert_split_invariant("a😀😀x😀", &["😀x"]);
    assert_split_invariant("ñañu", &["ñu"]);
    assert_split_invariant("日本日本語", &["本語", "日本日x"]);
    assert_split_invariant("ÿÿÿé", &["ÿé", "€"]);
}

#[test]
fn no_stops_or_no_match() {
    assert_split_invariant("plain text", &[]);
    assert_split_invariant("plain text", &[""]);
    assert_split_invariant("plain text", &["zzz", "tex!"]);
    assert_split_invariant("", &["x"]);
}

/// Long outputs: a deterministic pseudo-random text and pseudo-random splits.
#[test]
fn long_text_random_splits() {
    let alphabet: Vec<char> = "ab<>/sé日\n".chars().collect();
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let stops = ["</s>", "<<a", "ab日b", "\n\n"];
    for _ in 0..200 {
        let len = (next() % 300) as usize;
        let text: String = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        let expected = reference(&text, &stops);
        for _ in 0..10 {
            let mut pieces = Vec::new();
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let chars = 1 + (next() % 6) as usize;
                let cut = rest
                    .char_indices()
                    .nth(chars)
                    .map_or(rest.len(), |(at, _)| at);
                pieces.push(&rest[..cut]);
                rest = &rest[cut..];
            }
            assert_eq!(stream(&pieces, &stops, &expected.0), expected, "{text:?}");
        }
    }
}
