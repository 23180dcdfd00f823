//! `memprof completions SHELL`: clap's completion script, generated from the command line's
//! definition so that it never drifts from it, taught one thing clap cannot know: the value of
//! `-p`/`--pid` is the id of a running process, not a file name.

use clap::CommandFactory as _;
use clap_complete::Shell;

use crate::{cli::Cli, commands::output};

/// Prints `shell`'s completion script to stdout.
pub fn completions(shell: Shell) -> anyhow::Result<i32> {
    output::print(script(shell).as_bytes())?;
    Ok(0)
}

fn script(shell: Shell) -> String {
    let mut command = Cli::command();
    // Into memory first: clap_complete panics on a write error (`| head`).
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command, "memprof", &mut script);
    let script = String::from_utf8_lossy(&script).into_owned();
    let with_pid = subcommands_with_pid(&command);
    match shell {
        Shell::Bash => bash_with_pids(&script, &with_pid),
        Shell::Zsh => zsh_with_pids(&script),
        Shell::Fish => fish_with_pids(script, &with_pid),
        // Elvish and PowerShell complete the value as clap says: anything.
        _ => script,
    }
}

/// The subcommands that take `-p`/`--pid`: `attach`, `daemon`, `inspect`, `snapshot`.
fn subcommands_with_pid(command: &clap::Command) -> Vec<String> {
    command
        .get_subcommands()
        .filter(|sub| sub.get_arguments().any(|arg| arg.get_long() == Some("pid")))
        .map(|sub| sub.get_name().to_string())
        .collect()
}

/// A function around clap's `_memprof` that answers for `-p`/`--pid` in those subcommands and
/// leaves every other word to clap's, registered in its place.
fn bash_with_pids(script: &str, with_pid: &[String]) -> String {
    let script = script.replace("complete -F _memprof ", "complete -F _memprof_with_pids ");
    format!(
        r#"{script}
# memprof: the value of -p/--pid is the id of a running process.
_memprof_with_pids() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    case "${{COMP_WORDS[1]}}" in
        {subcommands})
            if [[ "$prev" == -p || "$prev" == --pid ]]; then
                COMPREPLY=($(compgen -W "$(cd /proc && echo [0-9]*)" -- "$cur"))
                return 0
            fi
            ;;
    esac
    _memprof "$@"
}}
"#,
        subcommands = with_pid.join("|"),
    )
}

/// zsh's own `_pids` (ids with their commands) for the value of each `-p`/`--pid` spec.
fn zsh_with_pids(script: &str) -> String {
    let specs = ["'-p+[", "'*-p+[", "'--pid=[", "'*--pid=["];
    let mut out = String::with_capacity(script.len());
    for line in script.split_inclusive('\n') {
        match line.strip_suffix(":_default' \\\n") {
            Some(spec) if specs.iter().any(|start| line.starts_with(start)) => {
                out.push_str(spec);
                out.push_str(":_pids' \\\n");
            }
            _ => out.push_str(line),
        }
    }
    out
}

/// fish's own `__fish_complete_pids` (ids with their commands), and no file names, for `-p`/`--pid`.
fn fish_with_pids(mut script: String, with_pid: &[String]) -> String {
    script.push_str("# memprof: the value of -p/--pid is the id of a running process.\n");
    for sub in with_pid {
        script.push_str(&format!(
            "complete -c memprof -n \"__fish_memprof_using_subcommand {sub}\" -s p -l pid -x -a \"(__fish_complete_pids)\"\n"
        ));
    }
    script
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subcommands_with_a_pid_are_those_that_trace_or_ask_about_one_process() {
        assert_eq!(subcommands_with_pid(&Cli::command()), ["attach", "daemon", "snapshot", "inspect"]);
    }

    #[test]
    fn bash_registers_the_function_that_completes_pids() {
        let bash = script(Shell::Bash);
        assert!(!bash.contains("complete -F _memprof "), "clap's function is no longer registered itself");
        assert_eq!(bash.matches("complete -F _memprof_with_pids ").count(), 2, "{bash}");
        assert!(bash.contains("        attach|daemon|snapshot|inspect)\n"), "{bash}");
    }

    #[test]
    fn zsh_completes_every_pid_option_with_its_pids_function() {
        let zsh = script(Shell::Zsh);
        // -p and --pid of each of the four subcommands.
        assert_eq!(zsh.matches(":_pids' \\\n").count(), 8, "{zsh}");
        assert!(zsh.contains("'*-p+[Trace this process (repeatable)]:N:_pids' \\\n"), "{zsh}");
        assert!(zsh.contains("'--interval=[Seconds between reports (at least 0.1)]:INTERVAL:_default' \\\n"));
    }

    #[test]
    fn fish_completes_pids_in_each_subcommand_with_a_pid() {
        let fish = script(Shell::Fish);
        assert_eq!(fish.matches("-s p -l pid -x -a \"(__fish_complete_pids)\"\n").count(), 4, "{fish}");
        assert!(fish.contains("__fish_memprof_using_subcommand snapshot\" -s p -l pid -x -a"), "{fish}");
    }
}
