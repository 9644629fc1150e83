// Building DOM nodes without HTML strings: text always goes in as text nodes, so nothing a
// model or a user wrote can become markup.

/** Creates `<tag>` with attributes, properties, listeners (`onclick: fn`) and children. */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "value" || key === "checked") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

/** Appends children: nodes, strings (as text), arrays of either; null and false are skipped. */
export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replaces all of `el`'s children. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/** Says `text` to screen readers through the page's live region. */
export function announce(text) {
  const region = document.getElementById("announcer");
  if (!region) return;
  region.textContent = "";
  // A new text node after a tick, so the same sentence twice is read twice.
  setTimeout(() => { region.textContent = text; }, 50);
}
