// Heap in use over time: the process's in-use bytes at each interval, and one line for each stack
// that has been a leak candidate, drawn as inline SVG.
'use strict';

const CHART = { width: 1000, height: 320, left: 90, right: 20, top: 16, bottom: 40 };
// Series longer than this are drawn as lines only: markers that close together say nothing more.
const MAX_MARKERS = 400;
const SERIES_COLORS = ['#d62728', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#bcbd22', '#17becf', '#2ca02c'];

function timelineSection(report) {
  const timeline = report.timeline;
  if (!timeline || timeline.time_s.length === 0) {
    return section('timeline', 'Heap in use over time',
      el('p', { class: 'note' }, 'No timeline: it is kept for the final report, one point per interval.'));
  }
  const series = [{ name: 'whole process', color: '#1f77b4', first: 0, values: timeline.outstanding_bytes, id: 'total' }];
  timeline.stacks.forEach((stack, i) => {
    const known = report.stacks.find(s => s.stack_id === stack.stack_id);
    const what = known && known.leak.candidate ? 'leak: ' : 'was a leak candidate: ';
    series.push({
      name: what + (known ? siteText(known.frames[0]) : 'stack ' + stack.stack_id + ' (no longer in use)'),
      color: SERIES_COLORS[i % SERIES_COLORS.length],
      first: stack.first,
      values: stack.outstanding_bytes,
      id: stack.stack_id,
    });
  });
  const peak = report.peak && report.peak.bytes > 0 ? report.peak : null;
  const note = peak ? el('p', { class: 'note' },
    `Peak (marked): ${grouped(peak.bytes)} bytes in use at ${seconds(peak.at_s)}, held by ${peak.stacks.length} stacks.`) : false;
  return section('timeline', 'Heap in use over time', chart(timeline.time_s, series, peak), note, legend(series));
}

// `peak`, when given, is marked: the process's high-water mark, which may fall between points.
function chart(times, series, peak) {
  const { width, height, left, right, top, bottom } = CHART;
  // Fine steps: the axis ends at most a quarter past the last point.
  const maxTime = niceCeiling(Math.max(times[times.length - 1], peak ? peak.at_s : 0, 1e-3), [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]);
  const highest = series.reduce((most, s) => s.values.reduce((a, b) => Math.max(a, b), most), peak ? peak.bytes : 1);
  const maxBytes = byteCeiling(highest);
  const x = t => left + (t / maxTime) * (width - left - right);
  const y = b => top + (1 - b / maxBytes) * (height - top - bottom);
  const svg = svgEl('svg', { id: 'timeline-chart', viewBox: `0 0 ${width} ${height}`, width, height, role: 'img' },
    svgEl('title', {}, 'Heap in use over time'));
  for (let i = 0; i <= 4; i++) {
    const bytes = (maxBytes * i) / 4;
    svg.append(
      svgEl('line', { class: 'grid', x1: left, x2: width - right, y1: y(bytes), y2: y(bytes) }),
      svgEl('text', { class: 'axis', x: left - 6, y: y(bytes) + 4, 'text-anchor': 'end' }, human(Math.round(bytes))));
  }
  for (let i = 0; i <= 5; i++) {
    const t = (maxTime * i) / 5;
    svg.append(svgEl('text', { class: 'axis', x: x(t), y: height - bottom + 18, 'text-anchor': 'middle' }, +t.toFixed(3) + ' s'));
  }
  svg.append(svgEl('text', { class: 'axis', x: (left + width - right) / 2, y: height - 4, 'text-anchor': 'middle' },
    'seconds since tracing began'));
  for (const s of series) {
    const points = s.values.map((bytes, i) => [x(times[s.first + i]).toFixed(1), y(bytes).toFixed(1), times[s.first + i], bytes]);
    const group = svgEl('g', { class: 'series', 'data-series': s.id, 'data-points': points.length },
      svgEl('polyline', { points: points.map(p => p[0] + ',' + p[1]).join(' '), stroke: s.color }));
    for (const [px, py, t, bytes] of points.length <= MAX_MARKERS ? points : []) {
      group.append(svgEl('circle', { cx: px, cy: py, r: 3, fill: s.color, 'data-bytes': bytes },
        svgEl('title', {}, `${s.name}: ${grouped(bytes)} bytes at ${seconds(t)}`)));
    }
    svg.append(group);
  }
  if (peak) {
    svg.append(svgEl('circle', { class: 'peak', cx: x(peak.at_s).toFixed(1), cy: y(peak.bytes).toFixed(1), r: 6,
      fill: 'none', stroke: '#d62728', 'stroke-width': 2, 'data-bytes': peak.bytes },
      svgEl('title', {}, `peak: ${grouped(peak.bytes)} bytes at ${seconds(peak.at_s)}`)));
  }
  return el('div', { class: 'chart' }, svg);
}

// The smallest of `steps` times a power of ten that is at least `value`.
function niceCeiling(value, steps) {
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  return power * (steps.find(step => step * power >= value) || 10);
}

// A top for the bytes axis whose quarters read well in the unit `human` picks (KiB, MiB, ...).
function byteCeiling(bytes) {
  const unit = Math.pow(1024, Math.max(0, Math.floor(Math.log(bytes) / Math.log(1024))));
  return unit * niceCeiling(bytes / unit, [1, 1.2, 1.6, 2, 2.4, 3.2, 4, 4.8, 6, 8, 10]);
}

function legend(series) {
  return el('ul', { class: 'legend' }, series.map(s => {
    const last = s.values.length ? grouped(s.values[s.values.length - 1]) + ' bytes at the last point' : 'no points';
    return el('li', { 'data-series': s.id },
      el('span', { class: 'swatch', style: `background:${s.color}` }), s.name + ': ' + last);
  }));
}
