// The call tree: every stack in use merged frame by frame, callers first or allocation sites
// first, filtered by a function or module name, with the paths of leak candidates in red.
// The filter and order can be given in the address: report.html#filter=parse&order=sites.
'use strict';

// Nodes whose share of the bytes is at least this are open at first: the heavy paths show.
const OPEN_SHARE = 0.1;

function treeSection(report) {
  const params = new URLSearchParams(location.hash.slice(1));
  const state = { filter: params.get('filter') || '', sitesFirst: params.get('order') === 'sites', open: new Set() };
  const total = report.stacks.reduce((sum, s) => sum + s.outstanding_bytes, 0);
  const input = el('input', { type: 'search', id: 'tree-filter', placeholder: 'filter by function or module name', value: state.filter });
  const order = el('select', { id: 'tree-order' },
    el('option', { value: 'callers' }, 'callers first'),
    el('option', { value: 'sites', selected: state.sitesFirst }, 'allocation sites first'));
  const expand = el('button', { type: 'button', id: 'tree-expand' }, 'Expand all');
  const collapse = el('button', { type: 'button', id: 'tree-collapse' }, 'Collapse all');
  const status = el('p', { id: 'tree-status' });
  const list = el('ul', { id: 'tree', class: 'tree' });
  let roots = [];

  const draw = () => {
    list.replaceChildren(...roots.map(node => nodeItem(node, state, total)));
  };
  const rebuild = () => {
    const query = state.filter.trim().toLowerCase();
    const shown = report.stacks.filter(s => s.outstanding_bytes > 0 && (!query || s.frames.some(f => matches(f, query))));
    roots = mergeStacks(shown, state.sitesFirst, query);
    state.open = new Set();
    walk(roots, node => {
      if (query ? node.leadsToMatch : node.bytes >= OPEN_SHARE * total) state.open.add(node.key);
    });
    const bytes = shown.reduce((sum, s) => sum + s.outstanding_bytes, 0);
    status.textContent = query
      ? `${shown.length} of ${report.stacks.length} stacks match, holding ${grouped(bytes)} of ${grouped(total)} bytes in use`
      : `${report.stacks.length} stacks holding ${grouped(total)} bytes in use`;
    draw();
  };
  const remember = () => {
    const hash = new URLSearchParams();
    if (state.filter) hash.set('filter', state.filter);
    if (state.sitesFirst) hash.set('order', 'sites');
    history.replaceState(null, '', '#' + hash.toString());
  };
  input.addEventListener('input', () => { state.filter = input.value; remember(); rebuild(); });
  order.addEventListener('change', () => { state.sitesFirst = order.value === 'sites'; remember(); rebuild(); });
  expand.addEventListener('click', () => { walk(roots, node => state.open.add(node.key)); draw(); });
  collapse.addEventListener('click', () => { state.open.clear(); draw(); });
  rebuild();
  // Spans, not list items: the section's lists are the tree's.
  const legend = el('p', { class: 'legend', id: 'tree-legend' },
    el('span', {}, el('span', { class: 'swatch leak' }), 'on the path of a leak candidate'),
    el('span', {}, el('span', { class: 'swatch' }), 'other bytes in use'));
  return section('tree', 'Call tree of the bytes in use',
    el('div', { class: 'controls' }, input, order, expand, collapse), status, legend, list);
}

function matches(frame, query) {
  return frame.function.toLowerCase().includes(query) || frame.module.toLowerCase().includes(query);
}

// The stacks merged into a forest: nodes are (function, module) pairs along each path.
function mergeStacks(stacks, sitesFirst, query) {
  const roots = new Map();
  for (const stack of stacks) {
    let frames = stack.frames.map(f => ({ name: f.function, module: basename(f.module), match: !!query && matches(f, query) }));
    if (frames.length === 0) frames = [{ name: '[no stack]', module: '', match: false }];
    else if (stack.truncated) frames.push({ name: '[truncated]', module: '', match: false });
    if (!sitesFirst) frames.reverse();
    let level = roots;
    let key = '';
    const path = [];
    for (const frame of frames) {
      key += '\u0000' + frame.name + '\u0001' + frame.module;
      let node = level.get(key);
      if (!node) {
        node = { key, name: frame.name, module: frame.module, bytes: 0, allocations: 0, leak: false, match: false, leadsToMatch: false, children: new Map() };
        level.set(key, node);
      }
      node.bytes += stack.outstanding_bytes;
      node.allocations += stack.outstanding_allocations;
      node.leak = node.leak || stack.leak.candidate;
      node.match = node.match || frame.match;
      path.push(node);
      level = node.children;
    }
    // Every node down to the deepest matching frame opens, so that the match and what it leads
    // to show.
    const deepest = path.map(n => n.match).lastIndexOf(true);
    path.slice(0, deepest + 1).forEach(n => { n.leadsToMatch = true; });
  }
  return sorted(roots);
}

function sorted(level) {
  return [...level.values()].sort((a, b) => b.bytes - a.bytes || a.name.localeCompare(b.name));
}

function walk(nodes, visit) {
  for (const node of nodes) {
    visit(node);
    walk(sorted(node.children), visit);
  }
}

function nodeItem(node, state, total) {
  const children = sorted(node.children);
  const open = children.length > 0 && state.open.has(node.key);
  const share = total > 0 ? (100 * node.bytes) / total : 0;
  const classes = ['node', node.leak && 'leak', node.match && 'match', open && 'open'].filter(Boolean).join(' ');
  const toggle = children.length > 0
    ? el('button', { type: 'button', class: 'toggle', 'aria-expanded': open }, open ? '▾' : '▸')
    : el('span', { class: 'toggle' }, '');
  const item = el('li', { class: classes, 'data-bytes': node.bytes },
    el('div', { class: 'row' },
      toggle,
      el('span', { class: 'bar' }, el('span', { class: 'fill', style: `width:${share.toFixed(2)}%` })),
      el('span', { class: 'bytes' }, grouped(node.bytes)),
      el('span', { class: 'share' }, share.toFixed(1) + '%'),
      el('span', { class: 'function' }, node.name),
      node.module ? el('span', { class: 'module' }, '[' + node.module + ']') : null),
    open ? el('ul', {}, children.map(child => nodeItem(child, state, total))) : null);
  if (children.length > 0) {
    toggle.addEventListener('click', () => {
      if (state.open.has(node.key)) state.open.delete(node.key);
      else state.open.add(node.key);
      item.replaceWith(nodeItem(node, state, total));
    });
  }
  return item;
}
