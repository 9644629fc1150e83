//! `TemplateError`: why a chat template could not be compiled or rendered.

use std::fmt;

/// Why a chat template could not be compiled or rendered.
///
/// Every variant carries what a person fixing the template or the request needs: the line of the
/// template (1-based) when the engine knows it, and the engine's or the template's own words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template source is not valid Jinja (an unclosed block, an unknown tag, a bad expression).
    #[error("chat template syntax error{}: {detail}", at_line(*line))]
    Syntax {
        /// Line of the template where the error was found.
        line: Option<usize>,
        /// What is wrong, in the engine's words.
        detail: String,
    },
    /// The template called `raise_exception(message)`: it refuses this conversation (a role it does
    /// not support, roles that do not alternate, a tool-call id of the wrong length …).
    #[error("chat template rejected the conversation: {message}")]
    Raised {
        /// The template's own message, exactly as it passed it.
        message: String,
    },
    /// Rendering failed for another reason: an operation on a value of the wrong type, an unknown
    /// filter, a missing attribute of an undefined value.
    #[error("chat template failed to render{}: {detail}", at_line(*line))]
    Render {
        /// Line of the template being rendered when it failed.
        line: Option<usize>,
        /// What went wrong, in the engine's words.
        detail: String,
    },
    /// The conversation could not be turned into template values (it must be JSON-like).
    #[error("chat template input is not usable: {detail}")]
    Input {
        /// What could not be converted.
        detail: String,
    },
}

impl TemplateError {
    /// A stable machine name for the variant, for logs and error bodies.
    pub fn error_type(&self) -> &'static str {
        match self {
            TemplateError::Syntax { .. } => "template_syntax",
            TemplateError::Raised { .. } => "template_raised",
            TemplateError::Render { .. } => "template_render",
            TemplateError::Input { .. } => "template_input",
        }
    }

    /// Turns a minijinja error from compiling a template into a [`TemplateError`].
    pub(crate) fn from_compile(err: &minijinja::Error) -> TemplateError {
        match raised_message(err) {
            Some(message) => TemplateError::Raised { message },
            None => TemplateError::Syntax {
                line: err.line(),
                detail: engine_detail(err),
            },
        }
    }

    /// Turns a minijinja error from rendering into a [`TemplateError`], recognising the ones that
    /// `raise_exception` produced.
    pub(crate) fn from_render(err: &minijinja::Error) -> TemplateError {
        if let Some(message) = raised_message(err) {
            return TemplateError::Raised { message };
        }
        match err.kind() {
            minijinja::ErrorKind::SyntaxError => TemplateError::Syntax {
                line: err.line(),
                detail: engine_detail(err),
            },
            _ => TemplateError::Render {
                line: err.line(),
                detail: engine_detail(err),
            },
        }
    }
}

/// The error `raise_exception` returns inside minijinja, found again in the error's source chain.
#[derive(Debug)]
pub(crate) struct RaisedByTemplate(pub(crate) String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

/// The engine's description of an error: its kind and detail, with the detail of every wrapped
/// error, without minijinja's own location suffix (the line is reported separately).
fn engine_detail(err: &minijinja::Error) -> String {
    let mut text = match err.detail() {
        // The variant already says "syntax error".
        Some(detail) if err.kind() == minijinja::ErrorKind::SyntaxError => detail.to_string(),
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    let mut source = std::error::Error::source(err);
    while let Some(current) = source {
        match current.downcast_ref::<minijinja::Error>() {
            Some(inner) => {
                if let Some(detail) = inner.detail() {
                    text.push_str(": ");
                    text.push_str(detail);
                }
            }
            None => {
                text.push_str(": ");
                text.push_str(&current.to_string());
            }
        }
        source = current.source();
    }
    text
}

fn at_line(line: Option<usize>) -> String {
    match line {
        Some(line) => format!(" at line {line}"),
        None => String::new(),
    }
}
