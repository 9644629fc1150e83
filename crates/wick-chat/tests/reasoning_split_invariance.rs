//! The reasoning split gives the same segments for every way of cutting the text into pieces.
//!
//! The reference splits the whole text at once with `str::find`. Streaming results are
//! compared after merging adjacent segments of one kind (how a client sees the deltas).
//! Short texts are tried with every split; long ones with every split into at most four
//! pieces, which covers every position of every tag boundary.
use wick_chat::reasoning::{ReasoningSplitter, ReasoningTags, Segment};

fn is_newline(c: char) -> bool {
    c == '\n' || c == '\r'
}

fn append(out: &mut Vec<Segment>, reasoning: bool, text: &str) {
    if text.is_empty() {
        return;
    }
    match (out.last_mut(), reasoning) {
        (Some(Segment::Reasoning(last)), true) | (Some(Segment::Content(last)), false) => {
            last.push_str(text)
        }
        _ => out.push(if reasoning {
            Segment::Reasoning(text.into())
        } else {
            Segment::Content(text.into())
        }),
    }
}

/// Whole-text reference of the documented rules.
fn reference(text: &str, tags: &ReasoningTags, start_in: bool, trim: bool) -> Vec<Segment> {
    let mut out = Vec::new();
    let (mut reasoning, mut block_start, mut rest) = (start_in, start_in && trim, text);
    loop {
        let tag = if reasoning { tags.close() } else { tags.open() };
        let (mut body, next) = match rest.find(tag) {
            Some(at) => (&rest[..at], Some(&rest[at + tag.len()..])),
            None => (rest, None),
        };
        if block_start {
            body = body.trim_start_matches(is_newline);
        }
        if reasoning && trim {
            body = body.trim_end_matches(is_newline);
        }
        append(&mut out, reasoning, body);
        match next {
            Some(after) => {
                rest = after;
                reasoning = !reasoning;
                block_start = trim;
            }
            None => return out,
        }
    }
}

fn stream(pieces: &[&str], tags: &ReasoningTags, start_in: bool, trim: bool) -> Vec<Segment> {
    let mut splitter =
        ReasoningSplitter::with_tags(start_in, tags.clone()).with_newline_trimming(trim);
    let mut out = Vec::new();
    let segments = pieces
        .iter()
        .flat_map(|piece| splitter.push(piece))
        .collect::<Vec<_>>()
        .into_iter()
        .chain(splitter.flush());
    for segment in segments {
        assert!(!segment.text().is_empty(), "empty segment from {pieces:?}");
        append(
            &mut out,
            matches!(segment, Segment::Reasoning(_)),
            segment.text(),
        );
    }
    out
}

/// Every split of `text` when it has at most 15 cut points, else every split into at most
/// four pieces.
fn splits(text: &str) -> Vec<Vec<&str>> {
    let cuts: Vec<usize> = text.char_indices().map(|(at, _)| at).skip(1).collect();
    let pick = |chosen: &[usize]| {
        let mut pieces = Vec::new();
        let mut from = 0;
        for &cut in chosen {
            pieces.push(&text[from..cut]);
            from = cut;
        }
        pieces.push(&text[from..]);
        pieces
    };
    let mut all = Vec::new();
    if cuts.len() <= 15 {
        for mask in 0u32..(1 << cuts.len()) {
            let chosen: Vec<usize> = (0..cuts.len())
                .filter(|bit| mask & (1 << bit) != 0)
                .map(|bit| cuts[bit])
                .collect();
            all.push(pick(&chosen));
        }
    } else {
        let n = cuts.len();
        all.push(pick(&[]));
        for a in 0..n {
            all.push(pick(&[cuts[a]]));
            for b in a + 1..n {
                all.push(pick(&[cuts[a], cuts[b]]));
                for c in b + 1..n {
                    all.push(pick(&[cuts[a], cuts[b], cuts[c]]));
                }
            }
        }
    }
    all
}

fn assert_split_invariant(text: &str, tags: &ReasoningTags) {
    for start_in in [false, true] {
        for trim in [true, false] {
            let expected = reference(text, tags, start_in, trim);
            for pieces in splits(text) {
                assert_eq!(
                    stream(&pieces, tags, start_in, trim),
                    expected,
                    "text {text:?}, start_in {start_in}, trim {trim}, pieces {pieces:?}"
                );
            }
        }
    }
}

#[test]
fn qwen3_and_deepseek_shapes() {
    let tags = ReasoningTags::default();
    for text in [
        "<think>\nWe add.\n</think>\n\n4",
        "Okay.\n</think>\n\nAnswer: 4",
        "<think>\n\n</think>\n\nHi",
        "<think>a</think>b<think>c</think>d",
        "no tags at all",
        "<think>cut off </thi",
        "a </thinking> b <thin",
        "<think>日本\n</think>\n語",
        "\r\n<think>\r\nx\r\n</think>\r\n\r\ny",
    ] {
        assert_split_invariant(text, &tags);
    }
}

#[test]
fn short_tags_every_split() {
    let tags = ReasoningTags::new("<t>", "</t>").expect("valid tags");
    for text in [
        "<t>\nab\n</t>\nc",
        "x<t</t>y</t",
        "<t><t></t></t>",
        "\n\n<t>\n</t>\n\n",
        "é<t>ü\n</t>\n😀",
        "<</t<t>>",
    ] {
        assert_split_invariant(text, &tags);
    }
}

#[test]
fn expected_segments_for_a_qwen3_answer() {
    let tags = ReasoningTags::default();
    let text = "<think>\nThe user greets.\n</think>\n\nHello!";
    assert_eq!(
        reference(text, &tags, false, true),
        vec![
            Segment::Reasoning("The user greets.".into()),
            Segment::Content("Hello!".into())
        ]
    );
    assert_split_invariant(text, &tags);
}
