//! llama.cpp's tokenizer test vectors (`ggml-vocab-*.gguf` with `.inp`/`.out`): every input must
//! encode to exactly the ids llama.cpp's `test-tokenizer-0` expects (no BOS/EOS, special-token
//! strings left as text).
use std::path::{Path, PathBuf};
use std::time::Instant;

use wick_chat::tokenizer::Tokenizer;

/// Vocabularies wick cannot tokenize like llama.cpp, with the reason. The test fails when one of
/// them starts passing (update this list) or when any other vocabulary fails.
const EXPECTED_FAILURES: &[(&str, &str)] = &[];

fn wick_home() -> PathBuf {
    match std::env::var_os("WICK_HOME") {
        Some(home) => PathBuf::from(home),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/wick"),
    }
}

fn assets_dir() -> PathBuf {
    let dir = wick_home().join("assets/llama.cpp");
    assert!(
        dir.is_dir(),
        "llama.cpp test assets are missing at {}: run `wick pull test-assets`",
        dir.display()
    );
    dir
}

/// The test cases of one vocabulary: inputs split on llama.cpp's separator, one line of ids each.
fn read_cases(gguf: &Path) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).expect("reads .inp");
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).expect("reads .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(sep) {
            Some(at) => {
                inputs.push(inp[pos..pos + at].to_string());
                pos += at + sep.len();
            }
            None => {
                inputs.push(inp[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{}: .inp and .out disagree on the number of cases",
        gguf.display()
    );
    inputs.into_iter().zip(outputs).collect()
}

/// Runs one vocabulary; `Err` describes the first mismatches.
fn check_vocab(gguf_path: &Path) -> Result<usize, String> {
    let gguf = wick_gguf::GgufFile::open(gguf_path).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let tok = Tokenizer::from_gguf(&gguf).map_err(|e| format!("build failed: {e}"))?;
    let built = started.elapsed();
    let cases = read_cases(gguf_path);
    let mut failures = Vec::new();
    for (text, expected) in &cases {
        match tok.encode_literal(text, false) {
            Ok(ids) if &ids == expected => {}
            Ok(ids) => failures.push(format!(
                "  {text:?}\n    expected {expected:?}\n    got      {ids:?}"
            )),
            Err(e) => failures.push(format!("  {text:?}: {e}")),
        }
    }
    eprintln!(
        "{}: {}/{} cases, built in {:?}",
        gguf_path.file_name().unwrap_or_default().to_string_lossy(),
        cases.len() - failures.len(),
        cases.len(),
        built
    );
    if failures.is_empty() {
        Ok(cases.len())
    } else {
        Err(failures.into_iter().take(5).collect::<Vec<_>>().join("\n"))
    }
}

#[test]
fn llama_cpp_vocab_vectors() {
    let dir = assets_dir();
    let mut vocabs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("lists assets")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("ggml-vocab-")
                && name.ends_with(".gguf")
                && p.with_extension("gguf.inp").exists()
                && p.with_extension("gguf.out").exists()
        })
        .collect();
    vocabs.sort();
    assert!(
        !vocabs.is_empty(),
        "no ggml-vocab-*.gguf with .inp/.out in {}: run `wick pull test-assets`",
        dir.display()
    );

    let mut passed = Vec::new();
    let mut failed = Vec::new();
    for path in &vocabs {
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .trim_start_matches("ggml-vocab-")
            .trim_end_matches(".gguf")
            .to_string();
        match check_vocab(path) {
            Ok(_) => passed.push(name),
            Err(why) => failed.push((name, why)),
        }
    }
    eprintln!("passed: {passed:?}");
    let failed_names: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
    let expected: Vec<&str> = EXPECTED_FAILURES.iter().map(|(n, _)| *n).collect();
    let unexpected: Vec<&(String, String)> = failed
        .iter()
        .filter(|(n, _)| !expected.contains(&n.as_str()))
        .collect();
    let fixed: Vec<&&str> = expected
        .iter()
        .filter(|n| !failed_names.contains(n))
        .collect();
    assert!(
        unexpected.is_empty() && fixed.is_empty(),
        "unexpected failures:\n{}\nexpected failures that now pass (update EXPECTED_FAILURES): {fixed:?}",
        unexpected
            .iter()
            .map(|(n, why)| format!("{n}:\n{why}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Vocabularies shipped without test vectors still load, except the unigram (`t5`) family,
/// which wick does not implement and must refuse by name.
#[test]
fn vocabularies_without_vectors_load_or_are_refused_by_name() {
    let dir = assets_dir();
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("lists assets") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        if !name.starts_with("ggml-vocab-")
            || !name.ends_with(".gguf")
            || path.with_extension("gguf.inp").exists()
        {
            continue;
        }
        seen += 1;
        let gguf = wick_gguf::GgufFile::open(&path).expect("opens");
        let model = gguf
            .metadata()
            .get_str("tokenizer.ggml.model")
            .expect("names its tokenizer")
            .to_string();
        match (model.as_str(), Tokenizer::from_gguf(&gguf)) {
            ("t5", Err(e)) => assert!(e.to_string().contains("'t5'"), "{name}: {e}"),
            ("t5", Ok(_)) => panic!("{name}: unigram vocabularies are not implemented"),
            (_, Ok(tok)) => {
                let ids = tok.encode("Hello world", false).expect("encodes");
                assert_eq!(
                    tok.decode(&ids, true).expect("decodes"),
                    "Hello world",
                    "{name}"
                );
            }
            (_, Err(e)) => panic!("{name}: {e}"),
        }
    }
    eprintln!("{seen} vocabularies without test vectors checked");
}
