// Reading a chat-completions stream: server-sent events into JSON chunks, and chunks into
// one reply (content, reasoning, tool calls with their repairs, finish reason, usage).

/** Yields the `data:` payload of each event of a `text/event-stream` response. */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + value).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

/** The reply a stream has built so far. */
export class Reply {
  constructor() {
    this.content = "";
    this.reasoning = "";
    /** `[{id, name, arguments, repairs}]` by call index. */
    this.toolCalls = [];
    this.finish = null;
    this.usage = null;
    this.error = null;
    this.firstTokenAt = null;
  }

  /** Adds one parsed chunk; returns false once the stream is over. */
  add(chunk, now = performance.now()) {
    if (chunk.error) {
      this.error = chunk.error.message ?? String(chunk.error);
      return false;
    }
    if (chunk.usage) this.usage = chunk.usage;
    for (const entry of chunk.wick_repairs ?? []) {
      const call = this.callAt(entry.index);
      call.repairs = entry.repairs ?? [];
    }
    for (const choice of chunk.choices ?? []) {
      const delta = choice.delta ?? {};
      if (delta.content || delta.reasoning_content || delta.tool_calls?.length) {
        this.firstTokenAt ??= now;
      }
      if (delta.content) this.content += delta.content;
      if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
      for (const piece of delta.tool_calls ?? []) {
        const call = this.callAt(piece.index ?? 0);
        if (piece.id) call.id = piece.id;
        if (piece.function?.name) call.name = piece.function.name;
        if (piece.function?.arguments) call.arguments += piece.function.arguments;
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
    return true;
  }

  callAt(index) {
    while (this.toolCalls.length <= index) {
      this.toolCalls.push({ id: null, name: "", arguments: "", repairs: [] });
    }
    return this.toolCalls[index];
  }
}
