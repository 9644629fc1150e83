// Markdown to DOM nodes, written for untrusted model output: every piece of text becomes a
// text node (no HTML string is ever parsed), raw HTML in the source shows as text, and
// links keep only http(s) and mailto targets. Covers what chat replies use: paragraphs,
// headings, fenced and indented code, lists (nested), block quotes, tables, rules, and
// inline code, bold, italic, strike-through and links. An unclosed fence (a reply still
// streaming) renders as a code block up to the end.

import { h } from "./dom.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

/** Renders `source` into a document fragment. */
export function render(source) {
  const fragment = document.createDocumentFragment();
  fragment.append(...blocks(String(source ?? "").replace(/\r\n?/g, "\n").split("\n")));
  return fragment;
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_RULE.test(next));
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trimStart().startsWith(fence)) body.push(lines[i++]);
      i += 1;
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      out.push(h(`h${Math.min(m[1].length + 2, 6)}`, {}, inline(m[2])));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(h("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      out.push(h("blockquote", {}, blocks(body)));
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, out);
    } else if (/^( {4}|\t)/.test(line)) {
      const body = [];
      while (i < lines.length && (/^( {4}|\t)/.test(lines[i]) || !lines[i].trim())) {
        body.push(lines[i++].replace(/^( {4}|\t)/, ""));
      }
      out.push(codeBlock(body.join("\n").replace(/\n+$/, ""), ""));
    } else {
      const body = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) body.push(lines[i++]);
      const p = h("p");
      body.forEach((text, n) => {
        if (n > 0) p.append(h("br"));
        p.append(inline(text.trim()));
      });
      out.push(p);
    }
  }
  return out;
}

function list(lines, start, out) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const el = ordered ? h("ol") : h("ul");
  if (ordered && parseInt(first[2], 10) !== 1) el.setAttribute("start", parseInt(first[2], 10));
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || /\d/.test(m[2]) !== ordered) break;
    const indent = m[1].length + m[2].length + 1;
    const body = [m[3]];
    i += 1;
    // The item's further lines: indented continuation (nested lists too), or a lazy line.
    while (i < lines.length) {
      const next = lines[i];
      if (!next.trim()) {
        if (i + 1 < lines.length && /^\s{2,}/.test(lines[i + 1])) {
          body.push("");
          i += 1;
          continue;
        }
        break;
      }
      if (/^\s{2,}/.test(next)) body.push(next.slice(Math.min(indent, next.length - next.trimStart().length)));
      else if (!startsBlock(next, lines[i + 1])) body.push(next.trim());
      else break;
      i += 1;
    }
    const li = h("li");
    if (body.length === 1) li.append(inline(body[0]));
    else li.append(...blocks(body));
    el.append(li);
    while (i < lines.length && !lines[i].trim() && i + 1 < lines.length && ITEM.test(lines[i + 1])) i += 1;
  }
  out.push(el);
  return i;
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(lines, start, out) {
  const head = cells(lines[start]);
  const align = cells(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : null);
  const cell = (tag, text, n) => h(tag, align[n] ? { class: `align-${align[n]}` } : {}, inline(text));
  const rows = [];
  let i = start + 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    rows.push(h("tr", {}, cells(lines[i]).map((c, n) => cell("td", c, n))));
    i += 1;
  }
  out.push(h("div", { class: "table-wrap" }, h("table", {},
    h("thead", {}, h("tr", {}, head.map((c, n) => cell("th", c, n)))),
    h("tbody", {}, rows))));
  return i;
}

function codeBlock(text, language) {
  const copy = h("button", { type: "button", class: "copy", "aria-label": "Copy code" }, "Copy");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  return h("div", { class: "code" },
    h("div", { class: "code-head" }, h("span", {}, language || "text"), copy),
    h("pre", { tabindex: "0" }, h("code", language ? { "data-lang": language } : {}, text)));
}

/** The link target if it is safe to follow, else null. */
export function safeUrl(href) {
  try {
    const url = new URL(href, document.baseURI);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

// One inline construct at a time, earliest first; code spans win over emphasis.
const INLINE = [
  ["code", /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/],
  ["link", /\[([^\]\n]+)\]\(\s*<?([^\s)>]+)>?(?:\s+"[^"]*")?\s*\)/],
  ["auto", /<((?:https?:\/\/|mailto:)[^\s<>]+)>/],
  ["strong", /\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__(?!\w)/],
  ["em", /\*(?=[^\s*])([^*]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/],
  ["del", /~~(?=\S)([\s\S]*?\S)~~/],
];

/** Renders inline Markdown of one line into a fragment. */
export function inline(text) {
  const fragment = document.createDocumentFragment();
  let rest = text;
  while (rest) {
    let best = null;
    for (const [kind, pattern] of INLINE) {
      const m = pattern.exec(rest);
      if (m && (!best || m.index < best.m.index)) best = { kind, m };
    }
    if (!best) {
      fragment.append(rest);
      break;
    }
    const { kind, m } = best;
    if (m.index > 0) fragment.append(rest.slice(0, m.index));
    if (kind === "code") fragment.append(h("code", {}, m[2].replace(/^ (.*) $/, "$1")));
    else if (kind === "link" || kind === "auto") {
      const label = kind === "link" ? m[1] : m[1];
      const href = safeUrl(kind === "link" ? m[2] : m[1]);
      fragment.append(href
        ? h("a", { href, target: "_blank", rel: "noopener noreferrer nofollow" }, inline(label))
        : inline(label));
    } else fragment.append(h(kind, {}, inline(m[1] ?? m[2])));
    rest = rest.slice(m.index + m[0].length);
  }
  return fragment;
}
