# Windows: rebuild llama-cpp-python, at the version pyproject.toml pins, for one backend profile
# (native\profiles\*.env, the same files native/build.sh reads).
#
#   powershell -ExecutionPolicy Bypass -File native\build.ps1 -Backend cuda [-CudaArch 89] [-Rpc] [-Source SDIST] [-DryRun]
#
# Profiles that work on Windows: cpu, cuda (CUDA toolkit + Visual Studio 2022 C++), vulkan (Vulkan SDK),
# sycl (oneAPI; run from the oneAPI command prompt), hip (AMD HIP SDK). Run from a "Developer PowerShell for
# VS 2022" so that CMake finds the compiler. ggml-rpc-server for other machines: use native/build.sh there.
param(
    [Parameter(Mandatory = $true)][string]$Backend,
    [string]$CudaArch = "",
    [string]$Source = "",
    [switch]$Rpc,
    [switch]$DryRun
)
$ErrorActionPreference = "Stop"
$root = Split-Path -Parent $PSScriptRoot
$profileFile = Join-Path $PSScriptRoot "profiles\$Backend.env"
if (-not (Test-Path $profileFile)) {
    $names = (Get-ChildItem (Join-Path $PSScriptRoot "profiles") -Filter *.env | ForEach-Object { $_.BaseName }) -join ", "
    throw "unknown profile '$Backend': choose one of $names"
}

$match = Select-String -Path (Join-Path $root "pyproject.toml") -Pattern '"llama-cpp-python==([0-9][0-9.]*)"' | Select-Object -First 1
if (-not $match) { throw "no llama-cpp-python==VERSION pin found in pyproject.toml" }
$version = $match.Matches[0].Groups[1].Value

# KEY="value" lines, as bash would source them
$vars = @{}
foreach ($line in Get-Content $profileFile) {
    if ($line -match '^([A-Z_]+)="(.*)"$') { $vars[$Matches[1]] = $Matches[2] }
}
$cmakeArgs = $vars["CMAKE_ARGS"]
if ($Rpc) { $cmakeArgs += " -DGGML_RPC=on" }
if ($CudaArch) { $cmakeArgs += " -DCMAKE_CUDA_ARCHITECTURES=$CudaArch" }
if ($env:FSD_CMAKE_ARGS) { $cmakeArgs += " $env:FSD_CMAKE_ARGS" }

foreach ($tool in ($vars["NEEDS"] -split " " | Where-Object { $_ })) {
    if (-not (Get-Command $tool -ErrorAction SilentlyContinue)) {
        $msg = "profile $Backend needs $tool on PATH"
        if ($DryRun) { Write-Warning $msg } else { throw $msg }
    }
}

$spec = if ($Source) { $Source } else { "llama-cpp-python==$version" }
$pipArgs = @("-m", "pip", "install", "--force-reinstall", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python", "-v", $spec)
Write-Host "# llama-cpp-python $version, profile $Backend"
Write-Host "`$env:CMAKE_ARGS = '$($cmakeArgs.Trim())'; python $($pipArgs -join ' ')"
if ($DryRun) { exit 0 }

$env:CMAKE_ARGS = $cmakeArgs.Trim()
$env:CMAKE_BUILD_PARALLEL_LEVEL = if ($env:CMAKE_BUILD_PARALLEL_LEVEL) { $env:CMAKE_BUILD_PARALLEL_LEVEL } else { "$env:NUMBER_OF_PROCESSORS" }
& python @pipArgs
if ($LASTEXITCODE -ne 0) { throw "pip failed (exit $LASTEXITCODE); see the log above" }
& fsd-local doctor
