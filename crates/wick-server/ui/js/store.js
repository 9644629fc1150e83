// Conversations kept in the browser (IndexedDB `wick-ui`, store `conversations`): each is
// `{id, title, system, created, updated, messages: [...]}`.

const DB = "wick-ui";
const STORE = "conversations";

let opened = null;

function open() {
  opened ??= new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => {
      const store = req.result.createObjectStore(STORE, { keyPath: "id" });
      store.createIndex("updated", "updated");
    };
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  return opened;
}

async function run(mode, work) {
  const db = await open();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const req = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(req?.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

/** Every conversation, most recently updated first. */
export async function list() {
  const all = await run("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

/** One conversation, or undefined. */
export function get(id) {
  return run("readonly", (s) => s.get(id));
}

/** Saves `conversation` (stamping `updated`). */
export function save(conversation) {
  conversation.updated = Date.now();
  return run("readwrite", (s) => s.put(structuredClone(conversation)));
}

/** Deletes a conversation. */
export function remove(id) {
  return run("readwrite", (s) => s.delete(id));
}

/** A new, empty conversation (not yet saved). */
export function create() {
  const now = Date.now();
  // getRandomValues works outside secure contexts too (a LAN address over http).
  const id = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");
  return { id, title: "New chat", system: "", created: now, updated: now, messages: [] };
}
