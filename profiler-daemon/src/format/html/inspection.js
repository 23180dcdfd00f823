// What `--inspect` found (the report's `inspection`, and each stack's `reachability` and
// `types`): a section of its own and a column of the stack table.
'use strict';

// [JSON name, what the page calls it], memcheck's classes in its order.
const CLASSES = [
  ['definitely_lost', 'definitely lost'],
  ['indirectly_lost', 'indirectly lost'],
  ['possibly_lost', 'possibly lost'],
  ['reachable', 'reachable'],
];

// `definitely lost 160 B in 4 (retaining 160 B); reachable 80 B in 1`: the classes a stack has blocks in.
function classesText(r) {
  if (!r) return '';
  return CLASSES.filter(([key]) => r[key + '_blocks'] > 0).map(([key, name]) =>
    `${name} ${grouped(r[key + '_bytes'])} B in ${grouped(r[key + '_blocks'])}` +
    (key === 'definitely_lost' ? ` (retaining ${grouped(r.retained_bytes)} B)` : '')).join('; ');
}

// `Circle 48 B in 3, ns::Widget 80 B in 2`
function typesText(types) {
  return (types || []).map(t => `${t.type} ${grouped(t.bytes)} B in ${grouped(t.blocks)}`).join(', ');
}

// The stack table's cell, when the process was inspected.
function reachabilityCell(stack) {
  const types = typesText(stack.types);
  return el('td', { class: 'reachability' }, classesText(stack.reachability), types ? el('div', { class: 'types' }, 'types: ' + types) : null);
}

function lostBytes(stack) {
  const r = stack.reachability;
  return r ? r.definitely_lost_bytes + r.indirectly_lost_bytes + r.possibly_lost_bytes : 0;
}

function inspectionSection(report) {
  const i = report.inspection;
  if (!i) return null;
  const pause = el('p', { id: 'inspection-summary' },
    `${i.threads} threads held still ${i.pause_ms.toFixed(1)} ms; ${bytesText(i.root_bytes_scanned)} of roots and ` +
    `${bytesText(i.block_bytes_scanned)} of blocks scanned, ${bytesText(i.bytes_unreadable)} unreadable; ` +
    `${bytesText(i.heap_bytes_not_classified)} of the heap not classified` +
    (i.unclassified_heap_scanned ? ' (scanned as roots).' : '.'));
  const classes = CLASSES.map(([key, name]) => el('tr', { class: key !== 'reachable' && i.totals[key + '_blocks'] > 0 ? 'bad' : undefined },
    el('th', {}, name),
    num(grouped(i.totals[key + '_bytes']), { 'data-key': key + '_bytes' }),
    num(grouped(i.totals[key + '_blocks']), { 'data-key': key + '_blocks' })));
  const types = (i.types || []).map(t => el('tr', { 'data-type': t.type },
    el('th', {}, t.type), num(grouped(t.bytes), { 'data-key': 'bytes' }), num(grouped(t.blocks), { 'data-key': 'blocks' })));
  const lost = report.stacks.filter(s => lostBytes(s) > 0).sort((a, b) => lostBytes(b) - lostBytes(a));
  const rows = lost.map(s => el('tr', { 'data-stack': s.stack_id },
    CLASSES.slice(0, 3).map(([key]) => num(grouped(s.reachability[key + '_bytes']), { 'data-key': key + '_bytes' })),
    num(grouped(s.reachability.retained_bytes), { 'data-key': 'retained_bytes' }),
    el('td', { class: 'types' }, typesText(s.types)),
    el('td', {}, stackDetails(s, true))));
  return section('inspection', 'Reachability (--inspect)', pause,
    el('div', { class: 'columns' },
      table(['class', 'bytes', 'blocks'], classes, { id: 'class-table' }),
      types.length > 0 ? table(['C++ type', 'bytes', 'blocks'], types, { id: 'type-table' })
        : el('p', { class: 'note' }, 'No block is a C++ object with a vtable.')),
    lost.length === 0 ? el('p', { id: 'nothing-lost', class: 'good' }, 'No block is lost: every one is reachable.') :
      table(['definitely lost', 'indirectly lost', 'possibly lost', 'retained', 'C++ types', 'stack (allocating site first)'],
        rows, { id: 'lost-table' }));
}
