// Helpers shared by the report's parts. Every text goes into the page as a text node, never as
// markup: function names hold '<', '>' and '&'.
'use strict';

const SVG_NS = 'http://www.w3.org/2000/svg';

// An element with attributes and children (nodes, or strings that become text).
function el(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

function svgEl(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

function build(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null && value !== false) node.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(typeof child === 'string' || typeof child === 'number' ? String(child) : child);
  }
  return node;
}

// 1234567 -> "1,234,567": exact, and the same in every locale.
function grouped(n) {
  return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ',');
}

// 71440 -> "69.8 KiB".
function human(bytes) {
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  if (bytes < 1024) return bytes + ' B';
  let value = bytes;
  let unit = 'B';
  for (const u of units) {
    if (value < 1024) break;
    value /= 1024;
    unit = u;
  }
  return value.toFixed(1) + ' ' + unit;
}

// Exact bytes, and the human size beside them once it differs.
function bytesText(bytes) {
  return bytes < 1024 ? grouped(bytes) + ' B' : grouped(bytes) + ' B (' + human(bytes) + ')';
}

// Nanoseconds as the largest unit that keeps a number of at least 1.
function duration(ns) {
  const units = [[1e9 * 3600, 'h'], [1e9 * 60, 'min'], [1e9, 's'], [1e6, 'ms'], [1e3, 'µs']];
  for (const [size, unit] of units) {
    if (ns >= size) return trim(ns / size) + ' ' + unit;
  }
  return ns + ' ns';
}

function trim(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

function seconds(s) {
  return s.toFixed(s < 10 ? 3 : 1) + ' s';
}

function basename(path) {
  return path ? path.slice(path.lastIndexOf('/') + 1) : '';
}

// "function (file:line)", or the function alone without debug info.
function siteText(frame) {
  if (!frame) return '[no stack]';
  if (frame.file && frame.line !== null) return frame.function + ' (' + basename(frame.file) + ':' + frame.line + ')';
  if (frame.file) return frame.function + ' (' + frame.file + ')';
  return frame.function;
}

// "function (file:line) [module] [inlined]", as the table format prints a frame.
function frameText(frame) {
  return siteText(frame) + ' [' + basename(frame.module) + ']' + (frame.inlined ? ' [inlined]' : '');
}

// A stack's frames, innermost first, the allocating site marked, and the allocation wrappers
// folded into the allocator, the caller's first, as the table format prints them.
function stackList(stack) {
  if (stack.frames.length === 0) return el('p', { class: 'note' }, '[no stack: see dropped]');
  const items = stack.frames.map((frame, i) => el('li', { class: i === 0 ? 'site' : undefined }, frameText(frame)));
  if (stack.via && stack.via.length > 0) items.push(el('li', { class: 'note' }, '[via ' + stack.via.slice().reverse().join(' > ') + ']'));
  if (stack.truncated) items.push(el('li', { class: 'note' }, '[truncated: see dropped]'));
  return el('ol', { class: 'frames' }, items);
}

// The stack's frames in a collapsed <details>, its summary naming the site.
function stackDetails(stack, site) {
  return el('details', { class: 'stack' },
    el('summary', {}, site ? siteText(stack.frames[0]) : stack.frames.length + ' frames'),
    stackList(stack));
}

function section(id, title, ...children) {
  return el('section', { id }, el('h2', {}, title), children);
}

function table(headers, rows, attrs) {
  return el('table', attrs || {},
    el('thead', {}, el('tr', {}, headers.map(h => el('th', {}, h)))),
    el('tbody', {}, rows));
}

function num(text, attrs) {
  return el('td', Object.assign({ class: 'num' }, attrs || {}), text);
}
