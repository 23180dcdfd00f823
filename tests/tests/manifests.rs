//! The Kubernetes manifests in deploy/: valid against the API server's schemas, strictly (an
//! unknown or misspelt field fails), from Kubernetes 1.25 (the first with Pod Security admission
//! stable) to the newest the validator knows; daemonset.yaml of core kinds only, so that applying
//! it needs no Prometheus Operator, and the Operator's kinds each in a file of its own.

use std::{path::PathBuf, process::Command};

use memprof_tests::workspace;
use serde::Deserialize as _;
use serde_yaml_ng::Value;

/// kubernetes-validate, installed by `cargo xtask setup` (xtask/src/setup.rs).
fn validator() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .join(".cache/memprof/kubernetes-validate/bin/kubernetes-validate")
}

/// The documents of the YAML file `deploy/NAME`.
fn documents(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(workspace().join("deploy").join(name)).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text).map(|doc| Value::deserialize(doc).unwrap()).collect()
}

fn kinds(name: &str) -> Vec<String> {
    documents(name).iter().map(|doc| doc["kind"].as_str().unwrap().to_string()).collect()
}

#[test]
fn the_manifests_pass_the_validator_from_kubernetes_1_25_to_the_newest() {
    for version in ["1.25.0", "1.37.0"] {
        let out = Command::new(validator())
            .args(["--strict", "--kubernetes-version", version])
            .args(["daemonset.yaml", "podmonitor.yaml", "prometheusrule.yaml"])
            .current_dir(workspace().join("deploy"))
            .output()
            .expect("kubernetes-validate (cargo xtask setup installs it)");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && !said.contains("ERROR"), "{version}: {said}");
        // Every core object checked; the Operator's kinds have no schema there (warned about).
        for object in
            ["namespace/memprof", "priorityclass/memprof-node-agent", "configmap/memprof", "daemonset/memprof"]
        {
            assert!(said.contains(&format!("passed for resource {object} against")), "{version}: {object}: {said}");
        }
    }
}

#[test]
fn the_daemonset_file_needs_no_operator_and_the_operators_kinds_stand_alone() {
    assert_eq!(kinds("daemonset.yaml"), ["Namespace", "PriorityClass", "ConfigMap", "DaemonSet"]);
    assert_eq!(kinds("podmonitor.yaml"), ["PodMonitor"]);
    assert_eq!(kinds("prometheusrule.yaml"), ["PrometheusRule"]);
    for name in ["daemonset.yaml", "podmonitor.yaml", "prometheusrule.yaml"] {
        for doc in documents(name) {
            let namespace = &doc["metadata"]["namespace"];
            let cluster_wide = ["Namespace", "PriorityClass"].contains(&doc["kind"].as_str().unwrap());
            assert!(cluster_wide || namespace.as_str() == Some("memprof"), "{name}: {doc:?}");
        }
    }
}

/// What a platform team relies on: a namespace that admits the pod and no other privileged one,
/// amd64 nodes only, every node's taints tolerated, a priority above workloads, bounded
/// resources, a read-only root, three capabilities, and a config that traces nothing until told.
#[test]
fn the_daemonset_runs_on_every_amd64_node_read_only_with_three_capabilities() {
    let docs = documents("daemonset.yaml");
    let labels = &docs[0]["metadata"]["labels"];
    for mode in ["enforce", "audit", "warn"] {
        assert_eq!(labels[format!("pod-security.kubernetes.io/{mode}").as_str()].as_str(), Some("privileged"));
    }
    let pod = &docs[3]["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], docs[1]["metadata"]["name"]);
    assert_eq!(pod["nodeSelector"]["kubernetes.io/arch"].as_str(), Some("amd64"));
    assert_eq!(pod["tolerations"][0]["operator"].as_str(), Some("Exists"));
    assert_eq!(pod["hostPID"].as_bool(), Some(true));
    let container = &pod["containers"][0];
    assert_eq!(container["image"].as_str(), Some(format!("memprof:{}", env!("CARGO_PKG_VERSION")).as_str()));
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["privileged"].as_bool(), Some(false));
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    let added: Vec<&str> =
        security["capabilities"]["add"].as_sequence().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert_eq!(added, ["SYS_ADMIN", "SYS_PTRACE", "DAC_READ_SEARCH"]);
    for bound in ["requests", "limits"] {
        assert!(container["resources"][bound]["memory"].as_str().is_some(), "{bound}");
    }
    // The ConfigMap's config: no rule, so the daemon starts idle and says how to add one.
    let config = docs[2]["data"]["memprof.toml"].as_str().unwrap();
    let settings: Vec<&str> = config.lines().filter(|line| !line.trim_start().starts_with('#')).collect();
    assert!(settings.contains(&"comms = []"), "{config}");
    for rule in ["pids", "cgroups", "all"] {
        assert!(!settings.iter().any(|line| line.starts_with(rule)), "{rule} in {config}");
    }
}
