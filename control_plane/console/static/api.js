// The admin API, called with the operator's key. Errors become ApiError with the problem's
// own words (RFC 9457 detail), so the page can say what went wrong instead of a status code.

const KEY_ITEM = "meridian.console.key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function savedKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

export function saveKey(key) {
  sessionStorage.setItem(KEY_ITEM, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
}

async function problemMessage(response) {
  try {
    const body = await response.json();
    return body.detail || body.title || response.statusText;
  } catch {
    return response.statusText || `HTTP ${response.status}`;
  }
}

export async function call(key, method, path, { body, accept = "json" } = {}) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: {
        Authorization: `Bearer ${key}`,
        ...(body !== undefined ? { "Content-Type": "application/json" } : {}),
      },
      body: body !== undefined ? JSON.stringify(body) : undefined,
      cache: "no-store",
      credentials: "omit",
    });
  } catch (e) {
    throw new ApiError(0, "cannot reach the control plane");
  }
  if (!response.ok) throw new ApiError(response.status, await problemMessage(response));
  if (accept === "blob") return response.blob();
  return response.status === 204 ? null : response.json();
}

export const get = (key, path, options) => call(key, "GET", path, options);
export const post = (key, path, body) => call(key, "POST", path, { body });

// What the login screen says about a key the control plane refused.
export function loginMessage(error) {
  if (error.status === 401) return `This key was refused: ${error.message}. Check that it is complete and not revoked.`;
  if (error.status === 403) return "This key may not read the fleet: the console needs an admin, operator or read-only key.";
  if (error.status === 0) return "Cannot reach the control plane. Is it running?";
  return `The control plane answered ${error.status}: ${error.message}`;
}
