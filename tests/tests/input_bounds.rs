//! Files given to memprof cost it what it says they may, whatever they hold: a small recording
//! whose reports repeat a stack of long frames thousands of times is refused before it is
//! rendered; a deflate bomb in a recording and a gzip bomb given to `diff` are cut at the 256
//! MiB the book states (docs: outputs/recordings.md#recordings), or sooner under a memory cgroup.

use std::{
    io::{Read as _, Write as _},
    path::PathBuf,
    process::Command,
};

use flate2::{read::DeflateDecoder, write::DeflateEncoder, write::GzEncoder, Compression, Crc};
use memprof_tests::{cgroup::MemoryCgroup, fixture, memprof_bin, peak_memory, run};
use serde_json::{json, Value};

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memprof-input-bounds-{}-{name}", std::process::id()))
}

const MAGIC: &[u8] = b"memprof recording 2\n";

/// The records of a recording, inflated.
fn records(bytes: &[u8]) -> Vec<Value> {
    let mut rest = bytes.strip_prefix(MAGIC).expect("a recording");
    let mut records = Vec::new();
    while rest.len() >= 8 {
        let length = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let mut json = Vec::new();
        DeflateDecoder::new(&rest[8..8 + length]).read_to_end(&mut json).unwrap();
        records.push(serde_json::from_slice(&json).unwrap());
        rest = &rest[8 + length..];
    }
    records
}

fn recording(records: &[Value]) -> Vec<u8> {
    let json: Vec<Vec<u8>> = records.iter().map(|record| serde_json::to_vec(record).unwrap()).collect();
    framed(json.iter().map(|record| vec![record.as_slice()]))
}

/// A recording of records each given as the pieces of its JSON, deflated as one stream.
fn framed<'a>(records: impl Iterator<Item = Vec<&'a [u8]>>) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    for pieces in records {
        let mut deflate = DeflateEncoder::new(Vec::new(), Compression::best());
        for piece in pieces {
            deflate.write_all(piece).unwrap();
        }
        let payload = deflate.finish().unwrap();
        let mut crc = Crc::new();
        crc.update(&payload);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc.sum().to_le_bytes());
        out.extend_from_slice(&payload);
    }
    out
}

/// A real recording's final report made to hold 20,000 stacks that all name one stack of 127
/// frames, each named with 4 KiB: under 1 MB on disk, 10 GB of frames written out. `memprof
/// report --format json` refuses it in one line before it renders, within 256 MiB (it took more
/// than 1 GiB before).
#[test]
fn a_small_recording_that_repeats_long_frames_is_refused_before_it_is_rendered() {
    let real = temp_path("real.rec");
    let outcome = run(&["--record", real.to_str().unwrap()], &[fixture("reports").to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let mut records = records(&std::fs::read(&real).unwrap());
    let _ = std::fs::remove_file(&real);
    let last = records.last_mut().unwrap();
    let pid = last["report"]["pid"].clone();
    let mut stack = last["report"]["stacks"].as_array().unwrap()[0].clone();
    stack["stack_id"] = json!("crafted");
    stack["frames"] = json!([]);
    stack["outstanding_allocations"] = json!(1);
    last["report"]["stacks"] = Value::Array(vec![stack; 20_000]);
    let frame = json!({"address": "0x1", "function": "f".repeat(4096), "file": null, "line": null, "module": "m", "inlined": false});
    // One frame, numbered after every frame the recording holds, 127 times in the stack.
    let new_frames = |record: &Value| record["new_frames"].as_array().map_or(0, Vec::len);
    let number = records.iter().map(new_frames).sum::<usize>();
    let last = records.last_mut().unwrap();
    let mut frames = last["new_frames"].as_array().cloned().unwrap_or_default();
    frames.push(frame);
    last["new_frames"] = Value::Array(frames);
    last["new_stacks"] = json!([{"pid": pid, "stack_id": "crafted", "frame_numbers": vec![number; 127]}]);
    let crafted = temp_path("crafted.rec");
    let bytes = recording(&records);
    assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
    std::fs::write(&crafted, &bytes).unwrap();
    let (code, stderr, peak) =
        peak_memory(Command::new(memprof_bin()).args(["report", crafted.to_str().unwrap(), "--format", "json"]));
    let _ = std::fs::remove_file(&crafted);
    eprintln!("memprof report of a {} KB crafted recording: peak {} MiB", bytes.len() >> 10, peak >> 20);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("names 2540000 frames"), "{stderr}");
    assert!(stderr.contains("more than memprof renders (8323072 frames"), "{stderr}");
    assert!(peak < 256 << 20, "peak {} MiB", peak >> 20);
}

/// 300 MiB of zeros gzip-compressed (300 KB), its trailer lying about its size, given to `diff`:
/// refused once 256 MiB came out, memprof's peak within 256 MiB and what memprof itself takes
/// (16 MiB). One whose trailer tells the truth is refused before it is decompressed.
#[test]
fn a_gzip_bomb_given_to_diff_costs_at_most_what_the_readme_says() {
    let bomb = temp_path("bomb.pb.gz");
    let mut gz = GzEncoder::new(Vec::new(), Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..300 {
        gz.write_all(&zeros).unwrap();
    }
    let mut bytes = gz.finish().unwrap();
    // Its trailer says 1 KiB: memprof finds out as it decompresses.
    let at = bytes.len() - 4;
    bytes[at..].copy_from_slice(&1024u32.to_le_bytes());
    std::fs::write(&bomb, bytes).unwrap();
    let (code, stderr, peak) =
        peak_memory(Command::new(memprof_bin()).args(["diff", bomb.to_str().unwrap(), bomb.to_str().unwrap()]));
    let _ = std::fs::remove_file(&bomb);
    eprintln!("memprof diff of a gzip bomb: peak {} MiB", peak >> 20);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("it decompresses to more than 256 MiB"), "{stderr}");
    assert!(peak < (256 + 16) << 20, "peak {} MiB", peak >> 20);
}

/// A recording whose second record is 300 MiB of JSON white space before its object (300 KB on
/// disk): `memprof report` refuses it in one line once 256 MiB came out, within 256 MiB; under a
/// memory cgroup of 192 MiB, once a quarter of what the cgroup leaves it came out.
#[test]
fn a_recording_whose_record_inflates_to_hundreds_of_mib_is_refused_within_bounds() {
    let start = br#"{"kind": "start", "settings": {"top": 10, "interval_s": 1.0}}"#.as_slice();
    let spaces = vec![b' '; 1 << 20];
    let bomb = std::iter::repeat_n(spaces.as_slice(), 300).chain([start]).collect();
    let path = temp_path("bomb.rec");
    std::fs::write(&path, framed([vec![start], bomb].into_iter())).unwrap();
    let (code, stderr, most) = peak_memory(Command::new(memprof_bin()).args(["report", path.to_str().unwrap()]));
    eprintln!("memprof report of a deflate bomb: peak {} MiB", most >> 20);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("a record inflates to more than 256 MiB"), "{stderr}");
    assert!(most < (256 + 16) << 20, "peak {} MiB", most >> 20);

    let group = MemoryCgroup::new(&format!("memprof-input-bounds-{}", std::process::id()), 192 << 20);
    let mut report = Command::new("sh");
    report.args(["-c", r#"echo $$ > "$0" && exec "$@""#]).arg(group.procs()).arg(memprof_bin());
    let (code, stderr, _) = peak_memory(report.args(["report", path.to_str().unwrap()]));
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("its records inflate to more than"), "{stderr}");
    assert!(stderr.contains(&format!("under its cgroup's memory limit ({})", group.limit_file())), "{stderr}");
    assert_eq!(group.oom_kills(), 0);
}

/// A gzip trailer's size is only a hint: one that says 300 MiB over an empty stream (a lie, or the
/// bytes a cut file ends in) is not believed, and the file is called damaged.
#[test]
fn a_profile_whose_trailer_lies_about_its_size_is_damaged() {
    let big = temp_path("big.pb.gz");
    let mut bytes = GzEncoder::new(Vec::new(), Compression::fast()).finish().unwrap();
    let at = bytes.len() - 4;
    bytes[at..].copy_from_slice(&(300u32 << 20).to_le_bytes());
    std::fs::write(&big, bytes).unwrap();
    let (code, stderr, _) =
        peak_memory(Command::new(memprof_bin()).args(["diff", big.to_str().unwrap(), big.to_str().unwrap()]));
    let _ = std::fs::remove_file(&big);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("big.pb.gz is damaged: cannot decompress it"), "{stderr}");
}

/// Endless files given where a recording, a config or a suppressions file goes are refused in
/// one line without being read whole: `/dev/zero` as a config took all of the host's memory.
#[test]
fn endless_files_are_refused_without_being_read_whole() {
    let recording = temp_path("endless.rec");
    assert!(run(&["--record", recording.to_str().unwrap()], &["true"]).status.success());
    let cases: [(&[&str], &str); 4] = [
        (&["report", "/dev/zero"], "is not a memprof recording"),
        (&["report", "/dev/urandom"], "is not a memprof recording"),
        (&["report", recording.to_str().unwrap(), "--suppressions", "/dev/zero"], "larger than"),
        (&["daemon", "--config", "/dev/zero", "--socket", "", "--listen", "127.0.0.1:0"], "larger than"),
    ];
    for (args, said) in cases {
        let (code, stderr, peak) = peak_memory(Command::new(memprof_bin()).args(args));
        assert_ne!(code, Some(0), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(said), "{args:?}: {stderr}");
        assert!(peak < 256 << 20, "{args:?} took {peak} bytes");
    }
    let _ = std::fs::remove_file(&recording);
}
