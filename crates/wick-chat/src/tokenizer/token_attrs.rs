//! What each vocabulary entry is (normal, control, user-defined, byte …), as GGUF's
//! `tokenizer.ggml.token_type` says and llama.cpp adjusts it.

/// A set of attributes of one token, stored as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TokenAttrs(u16);

impl TokenAttrs {
    /// Plain text piece.
    pub const NORMAL: Self = Self(1 << 0);
    /// The unknown token (`<unk>`): special, dropped when decoding with specials skipped.
    pub const UNKNOWN: Self = Self(1 << 1);
    /// A control token (`<s>`, `<|im_start|>` …): special, matched in text only when specials
    /// are parsed, dropped when decoding with specials skipped.
    pub const CONTROL: Self = Self(1 << 2);
    /// A user-defined token: always matched in text, always shown when decoding.
    pub const USER_DEFINED: Self = Self(1 << 3);
    /// A placeholder that never appears in text and decodes to nothing.
    pub const UNUSED: Self = Self(1 << 4);
    /// A byte-fallback token `<0xXX>`.
    pub const BYTE: Self = Self(1 << 5);
    /// Whitespace left of this token is swallowed when it is matched in text.
    pub const LSTRIP: Self = Self(1 << 6);
    /// Whitespace right of this token is swallowed when it is matched in text.
    pub const RSTRIP: Self = Self(1 << 7);

    /// Attributes of a GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte); anything else is "undefined": no attribute, decodes to nothing.
    pub fn from_gguf_type(token_type: i64) -> Self {
        match token_type {
            1 => Self::NORMAL,
            2 => Self::UNKNOWN,
            3 => Self::CONTROL,
            4 => Self::USER_DEFINED,
            5 => Self::UNUSED,
            6 => Self::BYTE,
            _ => Self(0),
        }
    }

    /// Whether every attribute of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any attribute of `other` is set.
    pub fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// `self` with the attributes of `other` added.
    pub fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// `self` with the attributes of `other` removed.
    pub fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    /// Control or unknown: a token that is skipped by `decode(…, skip_special = true)` and
    /// found in text only when special tokens are parsed.
    pub fn is_special(self) -> bool {
        self.intersects(Self::CONTROL.with(Self::UNKNOWN))
    }

    /// Whether this token is cut out of text before the model sees it: control and unknown
    /// tokens only when special tokens are parsed, user-defined tokens always (unless they are
    /// also control, as llama.cpp makes `</s>` in vocabularies that end generation on it).
    pub fn is_matched_in_text(self, parse_special: bool) -> bool {
        if self.is_special() {
            parse_special
        } else {
            self.contains(Self::USER_DEFINED)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_types_map_to_attributes() {
        assert_eq!(TokenAttrs::from_gguf_type(1), TokenAttrs::NORMAL);
        assert!(TokenAttrs::from_gguf_type(3).is_special());
        assert!(TokenAttrs::from_gguf_type(2).is_special());
        assert!(!TokenAttrs::from_gguf_type(4).is_special());
        assert!(TokenAttrs::from_gguf_type(4).is_matched_in_text(false));
        assert!(!TokenAttrs::from_gguf_type(3).is_matched_in_text(false));
        assert!(TokenAttrs::from_gguf_type(3).is_matched_in_text(true));
        let control_user = TokenAttrs::USER_DEFINED.with(TokenAttrs::CONTROL);
        assert!(!control_user.is_matched_in_text(false));
        assert!(control_user.is_matched_in_text(true));
        assert_eq!(TokenAttrs::from_gguf_type(99), TokenAttrs::default());
    }

    #[test]
    fn with_and_without_toggle_bits() {
        let a = TokenAttrs::CONTROL.with(TokenAttrs::RSTRIP);
        assert!(a.contains(TokenAttrs::RSTRIP));
        assert!(!a.without(TokenAttrs::RSTRIP).contains(TokenAttrs::RSTRIP));
        assert!(a.contains(TokenAttrs::CONTROL));
    }
}
