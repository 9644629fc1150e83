//! Token ids back to bytes the way llama.cpp renders pieces: byte-level pieces through GPT-2's
//! byte alphabet, `▁` back to a space, `<0xXX>` to its byte, control tokens verbatim or dropped.
use super::token_attrs::TokenAttrs;

/// How normal pieces of a vocabulary spell text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte alphabet: every byte is one printable character (`Ġ` is a space, `Ċ` a newline).
    ByteLevel,
    /// Raw UTF-8 with `▁` (U+2581) standing for a space (SentencePiece, Gemma 4, GGUF WordPiece).
    Spaced,
}

/// The bytes each token decodes to, laid out in one buffer.
#[derive(Debug)]
pub(crate) struct PieceTable {
    bytes: Vec<u8>,
    /// `ends[id]` is where token `id`'s bytes end; they start where `id - 1`'s end.
    ends: Vec<usize>,
    /// Control and unknown tokens, dropped when special tokens are skipped.
    special: Vec<bool>,
}

impl PieceTable {
    /// Renders every vocabulary entry once.
    pub fn new(tokens: &[String], attrs: &[TokenAttrs], style: PieceStyle) -> Self {
        let mut bytes = Vec::with_capacity(tokens.iter().map(String::len).sum());
        let mut ends = Vec::with_capacity(tokens.len());
        let mut special = Vec::with_capacity(tokens.len());
        for (token, &attr) in tokens.iter().zip(attrs) {
            render(token, attr, style, &mut bytes);
            ends.push(bytes.len());
            special.push(attr.is_special());
        }
        PieceTable {
            bytes,
            ends,
            special,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// The bytes of token `id`, or `None` outside the vocabulary.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.bytes[start..end])
    }

    /// Whether token `id` is dropped when special tokens are skipped.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }
}

/// Appends what one token decodes to.
fn render(token: &str, attr: TokenAttrs, style: PieceStyle, out: &mut Vec<u8>) {
    if attr.intersects(
        TokenAttrs::CONTROL
            .with(TokenAttrs::UNKNOWN)
            .with(TokenAttrs::USER_DEFINED),
    ) {
        out.extend_from_slice(token.as_bytes());
    } else if attr.contains(TokenAttrs::NORMAL) {
        match style {
            PieceStyle::ByteLevel => {
                for c in token.chars() {
                    match byte_of_char(c) {
                        Some(b) => out.push(b),
                        None => {
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
            }
            PieceStyle::Spaced => {
                for c in token.chars() {
                    if c == '\u{2581}' {
                        out.push(b' ');
                    } else {
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
        }
    } else if attr.contains(TokenAttrs::BYTE) {
        match byte_token_value(token) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(token.as_bytes()),
        }
    }
    // Unused and undefined tokens render as nothing, as in llama.cpp.
}

/// The byte a `<0xXX>` token stands for.
pub(crate) fn byte_token_value(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The byte a character of GPT-2's byte alphabet stands for.
///
/// Printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other
/// 68 bytes are shifted to U+0100.. in increasing order.
pub(crate) fn byte_of_char(c: char) -> Option<u8> {
    let code = c as u32;
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    let shifted = code.checked_sub(256)? as usize;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(shifted)
        .map(|b| b as u8)
}

/// The character of GPT-2's byte alphabet that stands for byte `b`.
pub(crate) fn char_of_byte(b: u8) -> char {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let b = u32::from(b);
    if printable(b) {
        return char::from_u32(b).unwrap_or('\u{FFFD}');
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or('\u{FFFD}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_round_trips() {
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_of_char('ĉ'), Some(b'\t'));
        assert_eq!(byte_of_char('a'), Some(b'a'));
        assert_eq!(byte_of_char('é'), Some(0xE9));
        assert_eq!(byte_of_char('中'), None);
        let mapped: std::collections::HashSet<u8> = (0u32..400)
            .filter_map(char::from_u32)
            .filter_map(byte_of_char)
            .collect();
        assert_eq!(mapped.len(), 256);
    }

    #[test]
    fn byte_alphabet_inverse() {
        for b in 0..=255u8 {
            assert_eq!(byte_of_char(char_of_byte(b)), Some(b));
        }
        assert_eq!(char_of_byte(b' '), 'Ġ');
        assert_eq!(char_of_byte(0x0B), 'ċ');
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(byte_token_value("<0x0A>"), Some(10));
        assert_eq!(byte_token_value("<0xff>"), Some(255));
        assert_eq!(byte_token_value("<0x0>"), None);
        assert_eq!(byte_token_value("0x0A"), None);
    }

    #[test]
    fn pieces_follow_token_kinds() {
        let tokens: Vec<String> = ["<s>", "▁Hello", "<0xE4>", "ĠHi", "<unused0>", "\n\n"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let attrs = [
            TokenAttrs::CONTROL,
            TokenAttrs::NORMAL,
            TokenAttrs::BYTE,
            TokenAttrs::NORMAL,
            TokenAttrs::UNUSED,
            TokenAttrs::USER_DEFINED,
        ];
        let spaced = PieceTable::new(&tokens, &attrs, PieceStyle::Spaced);
        assert_eq!(spaced.piece(0), Some(&b"<s>"[..]));
        assert_eq!(spaced.piece(1), Some(&b" Hello"[..]));
        assert_eq!(spaced.piece(2), Some(&[0xE4u8][..]));
        assert_eq!(spaced.piece(4), Some(&b""[..]));
        assert_eq!(spaced.piece(5), Some(&b"\n\n"[..]));
        assert_eq!(spaced.piece(6), None);
        assert!(spaced.is_special(0));
        assert!(!spaced.is_special(5));
        let bytes = PieceTable::new(&tokens, &attrs, PieceStyle::ByteLevel);
        assert_eq!(bytes.piece(3), Some(&b" Hi"[..]));
    }
}
