// Calls to wick's API from the page: same origin, JSON bodies declared as
// `application/json`, and the API key (asked for once, kept in sessionStorage) as
// `Authorization: Bearer`. A 401 asks for the key and retries.

const KEY = "wick.apiKey";

/** An answer that was not 2xx, with the message from wick's error body. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

let pendingKey = null;

/** Asks for the key with the page's dialog; concurrent callers share one question. */
function askKey(refused) {
  if (pendingKey) return pendingKey;
  pendingKey = new Promise((resolve, reject) => {
    const dialog = document.getElementById("key-dialog");
    const form = document.getElementById("key-form");
    const input = document.getElementById("key-input");
    const message = document.getElementById("key-message");
    message.textContent = refused
      ? "The server refused that key. Enter the key wick serve was started with (--api-key)."
      : "This server needs an API key (wick serve --api-key). It is kept for this tab only.";
    input.value = "";
    const done = () => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      pendingKey = null;
    };
    const onSubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      dialog.close();
      done();
      sessionStorage.setItem(KEY, key);
      resolve(key);
    };
    const onCancel = () => {
      done();
      reject(new ApiError(401, "an API key is needed"));
    };
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
    dialog.showModal();
    input.focus();
  });
  return pendingKey;
}

/** Forgets the key (the header's "Key" button) and asks again. */
export async function changeKey() {
  sessionStorage.removeItem(KEY);
  await askKey(false);
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message ?? message;
  } catch {
    // Not JSON: keep the status line.
  }
  return new ApiError(response.status, message);
}

/** `fetch` with the key and JSON body; resolves to the 2xx response, else throws ApiError. */
export async function request(path, { method = "GET", body, signal } = {}) {
  let refused = false;
  for (;;) {
    const headers = { Accept: "application/json, text/event-stream, text/plain" };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401) {
      if (key) sessionStorage.removeItem(KEY);
      await askKey(refused || Boolean(key));
      refused = true;
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }
}

/** GET (or the given method) and parse JSON. */
export async function getJson(path, options) {
  return (await request(path, options)).json();
}

/** GET and return the text (`/metrics`). */
export async function getText(path, options) {
  return (await request(path, options)).text();
}
