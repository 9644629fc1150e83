// Numbers as people read them.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

/** `1536` → `1.5 KiB`; null → `–`. */
export function bytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  let value = Number(n);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${UNITS[unit]}`;
}

/** A count or rate with at most `digits` decimals; null → `–`. */
export function number(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(Number(n))) return "–";
  const value = Number(n);
  return Number.isInteger(value) ? value.toLocaleString("en") : value.toLocaleString("en", { maximumFractionDigits: digits });
}

/** A fraction as a percentage; null → `–`. */
export function percent(fraction) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return "–";
  return `${(fraction * 100).toFixed(1)} %`;
}

/** Seconds as `1 h 2 min`, `3 min 4 s` or `5 s`. */
export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${s} s`;
}
