//! How rows become tokens, on the tiny Llama of `wick-engine/tests/goldens/hf/llama` (a
//! ChatML template): a string prompt is a user turn of the chat template, as mlx-lm renders
//! completions and as `wick serve` renders a chat request, unless raw prompts are asked for
//! or the model has no template.
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use wick_chat::chat_template::{normalize_messages, ChatInput};
use wick_engine::{LoadOptions, Model};
use wick_train::data::{
    self, Dataset, Example, Format, PromptStyle, Rendering, Sequence, TemplateKnown, Tokenizing,
};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../wick-engine/tests/goldens/hf/llama")
}

fn write_rows(dir: &Path, rows: &[Value]) {
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(dir.join("train.jsonl"), text).unwrap();
}

fn load(model: &Model, dir: &Path, preference: bool, style: PromptStyle) -> Dataset {
    data::load(
        dir,
        preference,
        &Tokenizing {
            model,
            max_seq: 512,
            prompt_style: style,
        },
    )
    .unwrap()
}

/// The template's text for `messages`, as the server renders a chat request.
fn render(model: &Model, messages: &[Value], generation_prompt: bool) -> String {
    model
        .chat_template()
        .unwrap()
        .render(&ChatInput {
            messages: normalize_messages(messages.to_vec()),
            tools: None,
            add_generation_prompt: generation_prompt,
            kwargs: Default::default(),
        })
        .unwrap()
}

fn sft(d: &Dataset) -> &Sequence {
    match &d.train[0] {
        Example::Sft(s) => s,
        other => panic!("not an SFT example: {other:?}"),
    }
}

fn pair(d: &Dataset) -> (&Sequence, &Sequence) {
    match &d.train[0] {
        Example::Pair { chosen, rejected } => (chosen, rejected),
        other => panic!("not a pair: {other:?}"),
    }
}

#[test]
fn a_string_prompt_is_a_user_turn_of_the_chat_template() {
    let model = Model::load(&tiny(), &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_rows(
        dir.path(),
        &[json!({"prompt": "Say hi", "completion": "HELLO THERE"})],
    );
    let d = load(&model, dir.path(), false, PromptStyle::Chat);
    assert_eq!(d.rendering, Rendering::UserTurn);
    let s = sft(&d);

    let user = [json!({"role": "user", "content": "Say hi"})];
    let whole = [
        user[0].clone(),
        json!({"role": "assistant", "content": "HELLO THERE"}),
    ];
    // The prompt is what a chat request for "Say hi" feeds the model…
    let served = model.tokenize(&render(&model, &user, true)).unwrap();
    assert_eq!(s.tokens[..s.prompt_len], served[..]);
    // …and the response is the reply through the template's end of turn (the model learns
    // to stop with `<|im_end|>`, the token the server stops at).
    assert_eq!(
        s.tokens,
        model.tokenize(&render(&model, &whole, false)).unwrap()
    );
    let im_end = model.tokenizer().token_id("<|im_end|>").unwrap();
    let reply = model
        .tokenizer()
        .decode(&s.tokens[s.prompt_len..], false)
        .unwrap();
    assert!(reply.starts_with("HELLO THERE<|im_end|>"), "{reply:?}");
    assert!(s.tokens[s.prompt_len..].contains(&im_end));
}

#[test]
fn preference_pairs_with_a_string_prompt_match_the_same_prompt_as_messages() {
    let model = Model::load(&tiny(), &LoadOptions::default()).unwrap();
    let as_string = tempfile::tempdir().unwrap();
    write_rows(
        as_string.path(),
        &[json!({"prompt": "Greet me", "chosen": "GOOD MORNING", "rejected": "good morning"})],
    );
    let as_messages = tempfile::tempdir().unwrap();
    write_rows(
        as_messages.path(),
        &[json!({"prompt": [{"role": "user", "content": "Greet me"}],
                 "chosen": "GOOD MORNING", "rejected": "good morning"})],
    );
    let a = load(&model, as_string.path(), true, PromptStyle::Chat);
    let b = load(&model, as_messages.path(), true, PromptStyle::Chat);
    assert_eq!(a.train, b.train);
    assert_eq!(a.rendering, Rendering::UserTurn);
    assert_eq!(b.rendering, Rendering::Messages);
    let (chosen, rejected) = pair(&a);
    assert_eq!(chosen.prompt_len, rejected.prompt_len);
    assert_eq!(
        chosen.tokens[..chosen.prompt_len],
        rejected.tokens[..rejected.prompt_len]
    );
    let prompt = model
        .tokenizer()
        .decode(&chosen.tokens[..chosen.prompt_len], false)
        .unwrap();
    assert!(
        prompt.ends_with("<|im_start|>user\nGreet me<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt:?}"
    );
}

#[test]
fn raw_prompts_are_plain_text_with_an_eos() {
    let model = Model::load(&tiny(), &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_rows(
        dir.path(),
        &[json!({"prompt": "Say hi", "chosen": "HELLO", "rejected": "hello"})],
    );
    let d = load(&model, dir.path(), true, PromptStyle::Raw);
    assert_eq!(d.rendering, Rendering::RawPrompt);
    let (chosen, _) = pair(&d);
    let mut want = model.tokenize("Say hi").unwrap();
    assert_eq!(chosen.prompt_len, want.len());
    want.extend(model.tokenizer().encode("HELLO", false).unwrap());
    want.push(model.tokenizer().token_id("<|im_end|>").unwrap());
    assert_eq!(chosen.tokens, want);
}

#[test]
fn a_model_without_a_chat_template_gets_raw_prompts() {
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(tiny()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.path().join(path.file_name().unwrap())).unwrap();
    }
    let config = copy.path().join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config, cfg.to_string()).unwrap();
    let model = Model::load(copy.path(), &LoadOptions::default()).unwrap();
    assert!(model.chat_template().is_none());

    let dir = tempfile::tempdir().unwrap();
    write_rows(
        dir.path(),
        &[json!({"prompt": "Say hi", "completion": "HELLO"})],
    );
    let d = load(&model, dir.path(), false, PromptStyle::Chat);
    assert_eq!(d.rendering, Rendering::RawNoTemplate);
    assert_eq!(sft(&d).prompt_len, model.tokenize("Say hi").unwrap().len());
}

#[test]
fn inspect_counts_string_prompts_and_names_the_rendering() {
    let dir = tempfile::tempdir().unwrap();
    write_rows(
        dir.path(),
        &[
            json!({"prompt": "a", "chosen": "B", "rejected": "b"}),
            json!({"prompt": [{"role": "user", "content": "c"}], "chosen": "D", "rejected": "d"}),
        ],
    );
    std::fs::write(
        dir.path().join("valid.jsonl"),
        "{\"prompt\": \"e\", \"chosen\": \"F\", \"rejected\": \"f\"}\n",
    )
    .unwrap();
    let s = data::inspect(dir.path()).unwrap();
    assert_eq!((s.format, s.n_train, s.n_valid), (Format::Preference, 2, 1));
    assert_eq!(s.string_prompts, 2);
    let chat = s.rendering(PromptStyle::Chat, TemplateKnown::Unknown);
    assert_eq!(chat, Rendering::UserTurnIfTemplate);
    assert_eq!(chat.name(), "chat_template");
    assert!(chat
        .describe()
        .contains("if the base model has no chat template"));
    let raw = s.rendering(PromptStyle::Raw, TemplateKnown::Present);
    assert_eq!((raw, raw.name()), (Rendering::RawPrompt, "raw"));
    assert_eq!(
        s.rendering(PromptStyle::Chat, TemplateKnown::Absent),
        Rendering::RawNoTemplate
    );

    // Only messages as prompts: the template whatever the flag says.
    write_rows(
        dir.path(),
        &[json!({"prompt": [{"role": "user", "content": "c"}], "completion": "D"})],
    );
    std::fs::remove_file(dir.path().join("valid.jsonl")).unwrap();
    let s = data::inspect(dir.path()).unwrap();
    assert_eq!(
        s.rendering(PromptStyle::Raw, TemplateKnown::Unknown),
        Rendering::Messages
    );
    write_rows(dir.path(), &[json!({"text": "plain"})]);
    let s = data::inspect(dir.path()).unwrap();
    assert_eq!(
        s.rendering(PromptStyle::Chat, TemplateKnown::Present)
            .name(),
        "raw"
    );
}
