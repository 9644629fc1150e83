// The UI's shell: a hash router over the pages listed in PAGES. A page is a module whose
// `mount(root)` builds it and returns the function that tears it down; adding a page (a
// fine-tune wizard, say) is one more entry here and one more file in ASSETS (routes/ui.rs).

import { changeKey } from "./api.js";
import { h, replace } from "./dom.js";

const PAGES = [
  { path: "chat", title: "Chat", load: () => import("./chat.js") },
  { path: "status", title: "Status", load: () => import("./status.js") },
  { path: "finetune", title: "Fine-tune", load: () => import("./finetune.js") },
];

const root = document.getElementById("page");
const nav = document.getElementById("nav");
let unmount = null;
let shown = null;

function pageOf(hash) {
  const path = hash.replace(/^#\/?/, "").split(/[/?]/)[0];
  return PAGES.find((p) => p.path === path) ?? PAGES[0];
}

async function show() {
  const page = pageOf(location.hash);
  if (page === shown) return;
  shown = page;
  for (const link of nav.querySelectorAll("a")) {
    link.toggleAttribute("aria-current", link.dataset.page === page.path);
    if (link.dataset.page === page.path) link.setAttribute("aria-current", "page");
  }
  document.title = `${page.title} · wick`;
  if (unmount) unmount();
  unmount = null;
  replace(root, h("p", { class: "hint" }, "Loading…"));
  try {
    const module = await page.load();
    if (shown !== page) return;
    unmount = await module.mount(root);
  } catch (e) {
    replace(root, h("p", { class: "error", role: "alert" }, `This page failed to load: ${e.message}`));
  }
}

replace(nav, PAGES.map((p) => h("a", { href: `#/${p.path}`, dataset: { page: p.path } }, p.title)));
document.getElementById("change-key").addEventListener("click", async () => {
  try {
    await changeKey();
    shown = null;
    show();
  } catch {
    // Cancelled: keep going without a key.
  }
});
window.addEventListener("hashchange", show);
show();
