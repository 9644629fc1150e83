//! Real chat templates rendered by wick must equal Python jinja2's renderings byte for byte.
//!
//! The references come from `scripts/goldens/chat_templates.py` (jinja2 set up as transformers sets
//! it up, cross-checked against transformers itself). Each `<template>/<conversation>.txt` is a
//! rendering; each `.err` records that Python failed: `raise_exception` + the template's message
//! (wick must fail with the same message), or `error <Class>` (wick must fail too).
//!
//! Where Python fails and wick renders, the Python error must be one of [`LENIENCIES`]: things
//! wick accepts on purpose, as llama.cpp does. Anything else is a mismatch.
//!
//! `WICK_CHAT_TEMPLATE_GOLDENS_ALL=DIR` also compares against a full run of the script
//! (`chat_templates.py --all DIR`) over every template; [`KNOWN_DIFFERENCES`] lists the renderings
//! that are known to differ there, and why.

mod chat_template_support;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use chat_template_support::{first_difference, Spec};
use wick_chat::chat_template::TemplateError;

/// Python errors that wick does not reproduce, on purpose: it renders instead.
const LENIENCIES: [(&str, &str); 4] = [
    (
        "'NoneType' object is not iterable",
        "minijinja loops over `none` as over an empty list (Hermes tool_use templates without tools)",
    ),
    (
        "access to attribute 'append' of 'list' object is unsafe",
        "lists in a namespace are mutable, as in llama.cpp (Kimi-K2's tool-call id queue)",
    ),
    ("No filter named 'from_json'", "llama.cpp's from_json filter is provided (DeepSeek V3.2/V4)"),
    (
        "Object of type generator is not JSON serializable",
        "`map`/`select` results are lists, so tojson accepts them (llama.cpp's DeepSeek-R1 template)",
    ),
];

/// Renderings known to differ from jinja2, with the reason; only met in the full run.
const KNOWN_DIFFERENCES: [(&str, &str); 1] = [(
    "meetkai-functionary-medium-v3.1",
    "`'…'|safe + text` makes a markupsafe Markup in Python, which HTML-escapes the tojson text \
     added to it (`&#34;`); minijinja's safe strings concatenate without escaping",
)];

/// How one comparison ended.
enum Outcome {
    Same,
    Differs(String),
    /// Python failed with one of the [`LENIENCIES`] and wick rendered.
    Superset(String),
}

fn compare(spec: &Spec, template: &Path, golden_dir: &Path) -> Result<Vec<(String, Outcome)>> {
    let compiled = spec.compile(template)?;
    let mut outcomes = Vec::new();
    for conversation in &spec.conversations {
        let txt = golden_dir.join(format!("{}.txt", conversation.name));
        let err = golden_dir.join(format!("{}.err", conversation.name));
        let ours = compiled.render(&conversation.input);
        let outcome = if txt.exists() {
            let expected = std::fs::read_to_string(&txt)?;
            match ours {
                Ok(actual) if actual == expected => Outcome::Same,
                Ok(actual) => Outcome::Differs(first_difference(&expected, &actual)),
                Err(e) => Outcome::Differs(format!("Python rendered it, wick failed: {e}")),
            }
        } else if err.exists() {
            let recorded = std::fs::read_to_string(&err)?;
            let (kind, message) = recorded.split_once('\n').unwrap_or((recorded.as_str(), ""));
            match (kind, ours) {
                ("raise_exception", Err(TemplateError::Raised { message: ours }))
                    if ours == message =>
                {
                    Outcome::Same
                }
                ("raise_exception", other) => Outcome::Differs(format!(
                    "Python: raise_exception({message:?}); wick: {other:?}"
                )),
                (_, Err(_)) => Outcome::Same,
                (kind, Ok(_)) => match LENIENCIES.iter().find(|(error, _)| message.contains(error))
                {
                    Some((_, why)) => {
                        Outcome::Superset(format!("Python failed ({kind}: {message}); {why}"))
                    }
                    None => Outcome::Differs(format!(
                        "Python failed ({kind}: {message}), wick rendered"
                    )),
                },
            }
        } else {
            continue;
        };
        outcomes.push((conversation.name.clone(), outcome));
    }
    Ok(outcomes)
}

fn run(golden_root: &Path, templates: &[PathBuf]) -> Result<()> {
    let spec = Spec::load()?;
    let mut failures = Vec::new();
    let mut supersets = Vec::new();
    let mut known = Vec::new();
    let mut same = 0;
    for template in templates {
        let stem = template
            .file_stem()
            .context("template name")?
            .to_string_lossy()
            .to_string();
        let golden_dir = golden_root.join(&stem);
        if !golden_dir.is_dir() {
            failures.push(format!("{stem}: no goldens in {}", golden_dir.display()));
            continue;
        }
        match compare(&spec, template, &golden_dir) {
            Ok(outcomes) => {
                for (conversation, outcome) in outcomes {
                    match outcome {
                        Outcome::Same => same += 1,
                        Outcome::Differs(why) => {
                            match KNOWN_DIFFERENCES.iter().find(|(name, _)| *name == stem) {
                                Some((_, reason)) => {
                                    known.push(format!("{stem} / {conversation}: {reason}"))
                                }
                                None => failures.push(format!("{stem} / {conversation}: {why}")),
                            }
                        }
                        Outcome::Superset(why) => {
                            supersets.push(format!("{stem} / {conversation}: {why}"))
                        }
                    }
                }
            }
            Err(e) => failures.push(format!("{stem}: {e:#}")),
        }
    }
    println!("{same} renderings identical to Python jinja2");
    for line in &supersets {
        println!("wick renders where jinja2 fails: {line}");
    }
    for line in &known {
        println!("known difference: {line}");
    }
    assert!(same > 0, "nothing was compared");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    Ok(())
}

#[test]
fn sample_matches_python_byte_for_byte() -> Result<()> {
    let spec = Spec::load()?;
    assert!(
        spec.golden_sample.len() >= 15,
        "the sample must hold at least 15 templates"
    );
    let dir = chat_template_support::templates_dir()?;
    let templates: Vec<PathBuf> = spec
        .golden_sample
        .iter()
        .map(|name| dir.join(name))
        .collect();
    run(&chat_template_support::goldens_dir(), &templates)
}

/// Run with `chat_templates.py --all DIR` first, then
/// `WICK_CHAT_TEMPLATE_GOLDENS_ALL=DIR cargo test -p wick-chat --test chat_template_goldens -- --ignored`.
#[test]
#[ignore = "needs a full Python run: WICK_CHAT_TEMPLATE_GOLDENS_ALL=DIR (see the module docs)"]
fn every_template_matches_a_full_python_run() -> Result<()> {
    let root = std::env::var_os("WICK_CHAT_TEMPLATE_GOLDENS_ALL").context(
        "set WICK_CHAT_TEMPLATE_GOLDENS_ALL to the DIR of `scripts/goldens/chat_templates.py --all DIR`",
    )?;
    run(Path::new(&root), &chat_template_support::template_files()?)
}
