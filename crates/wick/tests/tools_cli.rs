//! `wick tools parse` as a user runs it: reply on stdin, report on stdout.
use std::io::Write;
use std::process::{Command, Output, Stdio};

/// Runs `wick tools parse ARGS` with `reply` on stdin and returns what it did.
fn tools_parse(args: &[&str], reply: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(["tools", "parse"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start wick");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(reply.as_bytes()).expect("write the reply");
    drop(stdin);
    child.wait_with_output().expect("wait for wick")
}

/// A reader that closed its end before wick writes (`wick tools parse | head -0`) ends the
/// command quietly with status 0, as other command-line tools do, not with a panic.
#[test]
fn a_closed_stdout_is_not_an_error() {
    for args in [&["--json"][..], &[]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_wick"))
            .args(["tools", "parse"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start wick");
        // Close the reading end first: every write wick makes then fails with EPIPE.
        drop(child.stdout.take());
        let mut stdin = child.stdin.take().expect("stdin");
        let reply = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n".repeat(200);
        stdin.write_all(reply.as_bytes()).expect("write the reply");
        drop(stdin);
        let out = child.wait_with_output().expect("wait for wick");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{args:?}: {:?}, stderr: {stderr}",
            out.status
        );
        assert!(stderr.is_empty(), "{args:?}: stderr: {stderr}");
    }
}

/// Without --format or --model the reply's own markup picks the format.
#[test]
fn the_format_is_detected_from_the_reply() {
    let cases = [
        (
            "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>",
            "gemma4",
        ),
        (
            "<function name=\"get_weather\"><param name=\"city\">Paris</param></function>",
            "minicpm",
        ),
        (
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}",
            "mistral",
        ),
    ];
    for (reply, format) in cases {
        let out = tools_parse(&["--json"], reply);
        assert!(out.status.success(), "{reply}: {:?}", out);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        assert_eq!(report["format"], format, "{reply}");
        assert_eq!(report["calls"][0]["name"], "get_weather", "{reply}");
        assert_eq!(report["calls"][0]["arguments_json"], r#"{"city":"Paris"}"#);
    }
}
