// Draws the report embedded in #report-data (the JSON of `memprof --json`) into #app.
'use strict';

// Rows of the stack table; the call tree holds every stack.
const STACK_ROWS = 500;

function summarySection(report) {
  const t = report.totals;
  const rows = [
    ['outstanding_bytes', 'In use', bytesText(t.outstanding_bytes)],
    ['outstanding_allocations', 'Allocations in use', grouped(t.outstanding_allocations)],
    ['allocations', 'Allocations seen', grouped(t.allocations)],
    ['allocated_bytes', 'Bytes allocated', bytesText(t.allocated_bytes)],
    ['frees', 'Frees seen', grouped(t.frees)],
    ['freed_bytes', 'Bytes freed', bytesText(t.freed_bytes)],
    ['unknown_frees', 'Frees of memory allocated before tracing', grouped(t.unknown_frees)],
    ['internal_frees', "The C library's frees of its own blocks", grouped(t.internal_frees || 0)],
    ['failed_allocations', 'Failed allocations', grouped(t.failed_allocations)],
    ['double_frees', 'Double frees', grouped(report.double_frees.length)],
  ].concat(memoryRows(report.memory, report.blind_spots)).map(([key, label, value]) => el('tr', {}, el('th', {}, label), num(value, { 'data-key': key })));
  // Drops of no process in particular (the per-process table was full) are listed apart.
  const unattributed = Object.entries(report.unattributed_dropped || {});
  const lost = Object.values(report.dropped).concat(unattributed.map(([, n]) => n)).reduce((sum, n) => sum + n, 0);
  const recorded = report.sample_bytes || report.growth ? 'Nothing was dropped.' : 'Nothing was dropped: every allocator call was recorded.';
  const dropped = Object.entries(report.dropped).map(([reason, count]) =>
    el('tr', { class: count > 0 ? 'bad' : undefined }, el('th', {}, reason), num(grouped(count), { 'data-key': reason })))
    .concat(unattributed.map(([reason, count]) =>
      el('tr', { class: 'bad' }, el('th', {}, `${reason} (no process's)`), num(grouped(count)))));
  // The counters, all zero in a good trace, are folded away unless one is not.
  return section('summary', 'Totals',
    el('div', { class: 'columns' },
      el('table', { id: 'totals' }, el('tbody', {}, rows)),
      el('div', {},
        el('details', { id: 'drops', open: lost > 0 },
          el('summary', { id: 'dropped-summary', class: lost > 0 ? 'bad' : 'good' },
            lost > 0 ? `${grouped(lost)} events could not be recorded (docs: reference/drop-reasons.md#nothing-is-lost-silently gives each reason):`
              : recorded),
          el('table', { id: 'dropped' }, el('tbody', {}, dropped))),
        blindSpots(report),
        unwindTables(report.unwind_tables))));
}

// Resident memory against the heap (docs: guide/resident-memory.md#resident-memory-against-the-heap), when it was read.
// A runtime's heap that memprof does not see is the likeliest owner of the gap.
function memoryRows(memory, blindSpots) {
  if (!memory) return [];
  const unseen = blindSpots.map(s => s.heap).find(heap => heap);
  return [
    ['rss_anon_bytes', 'Resident anonymous memory' + (memory.age_s ? ` (last read ${memory.age_s} s before the end)` : ''),
      bytesText(memory.rss_anon_bytes)],
    ['difference_bytes', unseen ? `Resident outside the heap memprof sees (most likely ${unseen})` : 'Resident, not in blocks memprof saw allocated',
      (memory.difference_bytes < 0 ? '-' : '') + bytesText(Math.abs(memory.difference_bytes))],
    ['pinned_bytes', 'Resident pages pinned by blocks with less than a quarter of them live',
      `${bytesText(memory.pinned_bytes || 0)} in ${grouped(memory.pinned_pages || 0)} pages`],
  ];
}

// What memprof knows it does not see (docs: guide/allocators.md#blind-spots): said next to what was dropped.
function blindSpots(report) {
  if (report.blind_spots.length === 0) return el('p', { id: 'blind-spots', class: 'good' }, 'No blind spot known.');
  return el('ul', { id: 'blind-spots', class: 'bad' },
    report.blind_spots.map(s => el('li', { 'data-kind': s.kind }, `Not seen: ${s.what}. ${s.advice}.`)));
}

// The unwind tables of every traced process's files: in the root process's report only.
function unwindTables(tables) {
  if (!tables) return null;
  const rows = [
    ['files', 'Files with tables', grouped(tables.files)],
    ['rows_used', 'Rows used', grouped(tables.rows_used)],
    ...((tables.rows_idle ?? 0) > 0 ? [['rows_idle', 'Rows idle (kept for the next process)', grouped(tables.rows_idle)]] : []),
    ['rows_free', 'Rows free', grouped(tables.rows_free)],
    ['rows_max', 'Rows at most (--max-unwind-rows)', grouped(tables.rows_max)],
    ['kernel_bytes', 'Kernel memory', bytesText(tables.kernel_bytes)],
    ['tables_not_loaded', 'Tables not loaded', grouped(tables.tables_not_loaded)],
    ['rows_not_loaded', 'Rows they needed', grouped(tables.rows_not_loaded)],
  ].map(([key, label, value]) => el('tr', { class: key.endsWith('not_loaded') && tables[key] > 0 ? 'bad' : undefined },
    el('th', {}, label), num(value, { 'data-key': key })));
  return el('div', {},
    el('p', { id: 'unwind-summary', class: tables.tables_not_loaded > 0 ? 'bad' : 'good' },
      tables.tables_not_loaded > 0
        ? `${grouped(tables.tables_not_loaded)} unwind tables could not be loaded: their frames end stacks (unwind_no_table).`
        : 'Unwind tables: every mapped file\'s table is loaded.'),
    el('table', { id: 'unwind-tables' }, el('tbody', {}, rows)));
}

function leakSection(report) {
  const candidates = report.stacks.filter(s => s.leak.candidate).sort((a, b) => b.leak.score - a.leak.score);
  if (candidates.length === 0) {
    // Before the rule has seen a window of intervals, no verdict is no acquittal.
    const warming = report.stacks.find(s => s.leak.warming_up);
    const earlier = report.timeline ? report.timeline.stacks.length : 0;
    return section('leaks', 'Leak candidates', el('p', { id: 'no-leaks', class: warming ? 'note' : undefined },
      warming ? `No verdict yet: the leak rule is ${leakState(warming)}.`
        : earlier > 0 ? `No stack is a leak candidate now; ${grouped(earlier)} were earlier (their lines are in the timeline).`
          : 'No stack is a leak candidate.'), suppressedNote(report));
  }
  const rows = candidates.map(s => el('tr', { class: 'leak', 'data-stack': s.stack_id },
    num(s.leak.score.toFixed(2), { class: 'num score' }),
    num(grouped(s.outstanding_bytes), { 'data-key': 'outstanding_bytes' }),
    num(grouped(s.outstanding_allocations)),
    num(seconds(s.oldest_age_s)),
    el('td', { class: 'reason' }, s.leak.reason),
    el('td', {}, stackDetails(s, true))));
  return section('leaks', 'Leak candidates',
    table(['score', 'bytes in use', 'allocations in use', 'oldest', 'why', 'stack'], rows, { id: 'leak-table' }),
    suppressedNote(report));
}

// The stacks --suppressions accepted: no leak candidates, and never left out unsaid.
function suppressedNote(report) {
  const s = report.suppressed;
  if (!s) return null;
  const rules = s.by_rule.map(r => `${r.rule} (${grouped(r.stacks)})`).join(', ');
  return el('p', { id: 'suppressed', class: 'note' },
    `Suppressed: ${grouped(s.stacks)} stacks, ${grouped(s.bytes)} bytes, by rule ${rules}.`);
}

// `warming up (2 of 6 intervals)`: the rule has too few of the stack's intervals for a verdict.
function leakState(stack) {
  const w = stack.leak.warming_up;
  return `warming up (${w.seen} of ${w.window} intervals)`;
}

function stackSection(report) {
  const holding = report.stacks.filter(s => s.outstanding_allocations > 0);
  const shown = holding.slice(0, STACK_ROWS);
  const rows = shown.map(s => el('tr', { class: s.leak.candidate ? 'leak' : undefined, 'data-stack': s.stack_id },
    num(grouped(s.outstanding_bytes), { 'data-key': 'outstanding_bytes' }),
    num(grouped(s.outstanding_allocations), { 'data-key': 'outstanding_allocations' }),
    num(grouped(s.allocations)),
    num(grouped(s.allocated_bytes)),
    num(grouped(s.pinned_bytes || 0), { 'data-key': 'pinned_bytes' }),
    num(seconds(s.oldest_age_s)),
    num(s.leak.warming_up ? leakState(s) : s.leak.candidate ? s.leak.score.toFixed(2) : ''),
    report.inspection ? reachabilityCell(s) : null,
    el('td', {}, stackDetails(s, true))));
  const rest = holding.slice(STACK_ROWS);
  const restBytes = rest.reduce((sum, s) => sum + s.outstanding_bytes, 0);
  const headers = ['bytes in use', 'allocations in use', 'allocations', 'bytes allocated', 'resident bytes pinned', 'oldest', 'leak score']
    .concat(report.inspection ? ['reachability'] : [], ['stack (allocating site first)']);
  return section('stacks', 'Stacks holding memory',
    holding.length === 0 ? el('p', {}, 'No allocation is in use.') : table(headers, rows, { id: 'stack-table' }),
    rest.length > 0 ? el('p', { class: 'note' },
      `${grouped(rest.length)} more stacks hold ${grouped(restBytes)} bytes: they are in the call tree above.`) : null,
    report.stacks_not_shown ? el('p', { class: 'note', id: 'stacks-not-shown' },
      `${grouped(report.stacks_not_shown)} smaller stacks are left out of this page to keep it small: the JSON report and pprof profiles have them.`) : null);
}

// Anonymous memory from mmap, mremap and brk, by stack: apart from the heap, whose blocks count
// what the allocator mapped for them already.
function mappingSection(report) {
  const m = report.mappings;
  const title = 'Mapped memory (mmap, mremap, brk)';
  if (m.stacks.length === 0) return section('mappings', title, el('p', { class: 'note' }, 'No anonymous mapping is held.'));
  const rows = m.stacks.map(s => el('tr', { 'data-stack': s.stack_id },
    num(grouped(s.outstanding_bytes), { 'data-key': 'outstanding_bytes' }),
    num(grouped(s.ranges)),
    el('td', {}, s.in_allocator ? 'allocator' : 'program'),
    el('td', {}, stackDetails(s, true))));
  return section('mappings', title,
    el('p', { class: 'note' },
      `${bytesText(m.outstanding_bytes)} mapped outside the allocator; ${bytesText(m.allocator_bytes)} by the allocator for its blocks, which the heap counts already.`),
    table(['bytes mapped', 'ranges', 'mapped by', 'stack (the call first)'], rows, { id: 'mapping-table' }));
}

// A histogram as rows of bars; `label` names a bucket's range.
function histogram(id, title, buckets, label, empty) {
  if (buckets.length === 0) return section(id, title, el('p', { class: 'note' }, empty));
  const most = Math.max(...buckets.map(b => b.count));
  const total = buckets.reduce((sum, b) => sum + b.count, 0);
  const rows = buckets.map(b => el('tr', {},
    el('th', {}, label(b)),
    num(grouped(b.count), { 'data-key': 'count' }),
    el('td', { class: 'hbar' }, el('span', { style: `width:${((100 * b.count) / most).toFixed(1)}%` }))));
  return section(id, title, table(['range', 'count', ''], rows, { id: id + '-table', class: 'histogram' }),
    el('p', { class: 'note' }, `${grouped(total)} in all.`));
}

function sizeRange(b) {
  return b.min === b.max ? grouped(b.min) + ' B' : grouped(b.min) + ' – ' + grouped(b.max) + ' B';
}

function lifetimeRange(b) {
  return duration(b.min) + ' – ' + duration(b.max);
}

function threadSection(report) {
  if (report.thread_pairs.length === 0) {
    return section('threads', 'Freed by another thread',
      el('p', { class: 'note' }, 'No allocation was freed by another thread than the one that made it.'));
  }
  const rows = report.thread_pairs.map(p => el('tr', {},
    num(p.alloc_tid), num(p.free_tid), num(grouped(p.frees)), num(grouped(p.freed_bytes))));
  return section('threads', 'Freed by another thread',
    table(['allocating thread', 'freeing thread', 'frees', 'bytes freed'], rows, { id: 'thread-table' }));
}

// The heap in use by the thread that allocated it (`--threads`).
function threadUseSection(report) {
  if (!report.threads || report.threads.length === 0) return null;
  const rows = report.threads.map(t => el('tr', { 'data-tid': t.tid },
    el('td', {}, t.name ? `${t.tid} (${t.name})` : String(t.tid)),
    num(grouped(t.outstanding_bytes), { 'data-key': 'outstanding_bytes' }),
    num(grouped(t.outstanding_allocations), { 'data-key': 'outstanding_allocations' })));
  const estimates = report.sample_bytes ? el('p', { class: 'note' }, 'Sampled: estimates, each block scaled by its weight.') : null;
  return section('thread-use', 'In use by thread', estimates,
    table(['thread', 'bytes in use', 'allocations in use'], rows, { id: 'thread-use-table' }));
}

function doubleFreeSection(report) {
  if (report.double_frees.length === 0) return section('double-frees', 'Double frees', el('p', { class: 'note' }, 'None.'));
  return section('double-frees', 'Double frees', report.double_frees.map(d => el('div', { class: 'double-free bad' },
    el('h3', {}, `${d.address} (${grouped(d.size)} bytes)`),
    [['allocated', d.alloc], ['freed', d.first_free], ['freed again', d.second_free]].map(([what, site]) =>
      el('div', {}, `${what} by thread ${site.tid} at ${seconds(site.time_s)}`, stackList(site))))));
}

// When, where and how the trace was made.
function context(report) {
  const c = report.context;
  if (!c) return null;
  return el('p', { id: 'context', class: 'note' },
    `Started ${c.started} on ${c.host} by memprof ${c.memprof_version}: `, el('code', {}, c.command_line.join(' ')));
}

function render() {
  const report = JSON.parse(document.getElementById('report-data').textContent);
  const kind = report.live ? 'live report' : report.final ? 'final report' : 'report';
  // What one opens a heap report for first: the leaks and the heap over time.
  // Sections with nothing to show are null: left out (replaceChildren would print them).
  document.getElementById('app').replaceChildren(...[
    el('header', {},
      el('h1', {}, `memprof: pid ${report.pid} (${report.comm})`),
      // A report at the peak (`memprof report --at peak`) has bytes only.
      el('p', {}, report.at_peak
        ? `At its peak, ${seconds(report.duration_s)} after tracing began: ${bytesText(report.totals.outstanding_bytes)} in use; the peak keeps each stack's bytes, no counts`
        : `${kind} after ${seconds(report.duration_s)} of tracing: ${bytesText(report.totals.outstanding_bytes)} in use in ${grouped(report.totals.outstanding_allocations)} allocations`),
      context(report),
      report.sample_bytes ? el('p', { id: 'sampling', class: 'bad' },
        `Sampled: one allocation in every ${grouped(report.sample_bytes)} bytes is recorded; counts and bytes are estimates.`) : null,
      report.growth ? el('p', { id: 'growth', class: 'bad' },
        `Growth mode: pages of anonymous memory by the stack that first touched each, not allocator calls; an allocation is a page (${grouped(report.growth.outside_pages)} pages touched outside it).`) : null),
    leakSection(report),
    inspectionSection(report),
    timelineSection(report),
    summarySection(report),
    treeSection(report),
    stackSection(report),
    mappingSection(report),
    histogram('sizes', 'Allocation sizes', report.sizes, sizeRange, 'No allocation seen.'),
    histogram('lifetimes', 'Lifetimes of freed allocations', report.lifetimes, lifetimeRange, 'No allocation seen freed.'),
    threadUseSection(report),
    threadSection(report),
    doubleFreeSection(report)].filter(Boolean));
}

render();
