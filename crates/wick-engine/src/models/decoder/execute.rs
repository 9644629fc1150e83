//! What a step's rows ask of the forward pass ([`Want`]), what they get back
//! ([`RowOutput`]), and how one pass serves a mix of wants ([`Route`]).
use super::LogitsRequest;

/// What one sequence of a step asks the forward pass for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Nothing: a prefill chunk that is not the prompt's last.
    Nothing,
    /// The last position's logits, on the host (sampling, log-probabilities).
    Logits,
    /// Every new position's logits, on the host (scoring, teacher forcing, verifying drafts
    /// under a sampler).
    AllLogits,
    /// The argmax of the last position, picked on the backend (greedy decoding).
    Token,
    /// The argmax of the last position under the row's token mask (a greedy row under a
    /// grammar), picked on the backend; the masks come from [`StepMasks`].
    MaskedToken,
    /// The argmax of every new position, picked on the backend (a greedy row verifying
    /// its drafts).
    Tokens,
    /// The last position's final-normed hidden state (an embedding model's pooling).
    Hidden,
    /// Every new position's final-normed hidden state.
    AllHidden,
}

impl Want {
    /// Which positions the want reads.
    pub fn positions(self) -> LogitsRequest {
        match self {
            Want::Nothing => LogitsRequest::None,
            Want::Logits | Want::Token | Want::MaskedToken | Want::Hidden => LogitsRequest::Last,
            Want::AllLogits | Want::Tokens | Want::AllHidden => LogitsRequest::All,
        }
    }

    /// The want of a caller asking for logits of `positions`.
    pub fn logits(positions: LogitsRequest) -> Self {
        match positions {
            LogitsRequest::None => Want::Nothing,
            LogitsRequest::Last => Want::Logits,
            LogitsRequest::All => Want::AllLogits,
        }
    }

    /// Whether a step of `wants` picks tokens under masks, so that [`StepMasks`] will be
    /// called: a row wants a masked token and none needs logits or verifies drafts.
    pub fn picks_under_masks(wants: &[Want]) -> bool {
        Route::of(wants).ok() == Some(Route::MaskedArgmax)
    }

    fn is_hidden(self) -> bool {
        matches!(self, Want::Hidden | Want::AllHidden)
    }
}

/// What one sequence of a step gets back. A row gets what it asked for, except that when
/// the pass brings logits to the host for one row, every row asking for a token gets its
/// logits instead (and picks its token from them, as a sampler would).
#[derive(Debug, Clone, PartialEq)]
pub enum RowOutput {
    /// No output (the row asked for none).
    Nothing,
    /// Logits of the positions the row reads.
    Logits(super::Logits),
    /// The argmax of the last position.
    Token(u32),
    /// The argmax of every new position.
    Tokens(Vec<u32>),
    /// Final-normed hidden states (`[rows][hidden]`, row-major).
    Hidden(Vec<f32>),
}

/// The token masks of the rows that asked for [`Want::MaskedToken`]: called once the pass
/// is built and started on the backend (so the host computes the masks while a device
/// computes the logits), it returns one entry per row of the step (`None`: unmasked), each
/// a bit mask as [`crate::backend::Backend::masked_argmax`] takes it. Not called when no
/// row's token is picked under a mask.
pub type StepMasks<'a> = Box<dyn FnOnce() -> Vec<Option<Vec<u32>>> + 'a>;

/// How one forward pass serves its rows' wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// No row wants an output.
    Silent,
    /// Hidden states to the host.
    Hidden,
    /// Logits to the host.
    Logits,
    /// One argmax per row that wants a token.
    Argmax,
    /// One argmax per row that wants a token, under the rows' masks.
    MaskedArgmax,
    /// One argmax per position a row reads.
    ArgmaxRows,
}

impl Route {
    /// The one route that serves `wants`: logits when any row needs them (a masked row
    /// beside a verifying one also takes logits: the masked pass picks one token a row),
    /// else the narrowest argmax. Hidden states do not mix with logits or tokens.
    pub(crate) fn of(wants: &[Want]) -> crate::Result<Route> {
        let any = |f: fn(&Want) -> bool| wants.iter().any(f);
        if any(|w| w.is_hidden()) {
            if any(|w| !w.is_hidden() && *w != Want::Nothing) {
                return Err(crate::EngineError::InvalidInput(
                    "a forward pass returns hidden states or logits, not both".into(),
                ));
            }
            return Ok(Route::Hidden);
        }
        Ok(if wants.iter().all(|w| *w == Want::Nothing) {
            Route::Silent
        } else if any(|w| matches!(w, Want::Logits | Want::AllLogits)) {
            Route::Logits
        } else if any(|w| *w == Want::MaskedToken) {
            if any(|w| *w == Want::Tokens) {
                Route::Logits
            } else {
                Route::MaskedArgmax
            }
        } else if any(|w| *w == Want::Tokens) {
            Route::ArgmaxRows
        } else {
            Route::Argmax
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_route_serves_each_mix_of_wants() {
        use Want::*;
        let route = |w: &[Want]| Route::of(w).unwrap();
        assert_eq!(route(&[Nothing, Nothing]), Route::Silent);
        assert_eq!(route(&[Token, Nothing]), Route::Argmax);
        assert_eq!(route(&[Token, Logits]), Route::Logits);
        assert_eq!(route(&[Token, Tokens]), Route::ArgmaxRows);
        assert_eq!(route(&[MaskedToken, Token]), Route::MaskedArgmax);
        assert_eq!(route(&[MaskedToken, Tokens]), Route::Logits);
        assert_eq!(route(&[Hidden, Nothing]), Route::Hidden);
        assert!(Route::of(&[Hidden, Token]).is_err());
    }
}
